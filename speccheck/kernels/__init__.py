"""Kernel-level harnesses: what the kernel paths that speculative decoding switches between
do to the numbers, measured below the model (``gdn``: the gated delta rule)."""
