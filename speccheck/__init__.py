"""speccheck: a correctness and determinism gate for speculative decoding."""
__version__ = "0.1.0"
