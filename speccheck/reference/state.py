"""The GDN state after each position of a forward, kept for an exact rollback (its own module,
importing nothing of the engine, so that the GDN forms, model.py's and the fused kernel's, can
return it without importing each other)."""
from __future__ import annotations

from typing import Callable

import torch


class PerPositionStates:
    """The GDN state after each of T new positions, for exact rollback. Either stacked
    ([B,T,H,Dk,Dv], recurrent form) or, for a single chunk, kept as the chunk's parts and
    computed only for the one position that is asked for (the verify hot path)."""

    def __init__(self, stacked=None, parts=None, kernel=None,
                 kernel_state: Callable[[tuple, torch.Tensor], torch.Tensor] | None = None):
        #: kernel: the parts of the CPU kernel's chunk (kernels.cpu.gdn_chunk), and
        #: kernel_state the call that forms the state after a position from them in one C call
        #: (kernels.cpu.gdn_chunk_state)
        if (kernel is None) != (kernel_state is None):
            raise ValueError("PerPositionStates: give kernel and kernel_state together")
        self.stacked, self.parts, self.kernel = stacked, parts, kernel
        self.kernel_state = kernel_state

    def __len__(self) -> int:
        if self.kernel is not None:
            return self.kernel[1].shape[2]
        return self.stacked.shape[1] if self.stacked is not None else self.parts[1].shape[-1]

    def at(self, i: int) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel_state(self.kernel, torch.full((self.kernel[0].shape[0],), i))
        if self.stacked is not None:
            return self.stacked[:, i]
        s0, cum, decay, k, v_new = self.parts
        # S_i = exp(cum_i) S0 + sum_{j<=i} exp(cum_i - cum_j) k_j v_new_j^T
        dk = decay[:, :, i, : i + 1, None] * k[:, :, : i + 1]
        return cum[:, :, i].exp()[..., None, None] * s0 + dk.transpose(-1, -2) @ v_new[:, :, : i + 1]

    def at_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Row b's state after position idx[b] (a ragged batch keeps a count per sequence):
        one gather instead of a state per row. The masked decay row is zero past idx[b], so
        the sum runs over all T positions."""
        if self.kernel is not None:
            return self.kernel_state(self.kernel, idx)
        rows = torch.arange(idx.shape[0], device=idx.device)
        if self.stacked is not None:
            return self.stacked[rows, idx]
        s0, cum, decay, k, v_new = self.parts
        dk = decay[rows, :, idx][..., None] * k  # [B,H,T,Dk]
        return cum[rows, :, idx].exp()[..., None, None] * s0 + dk.transpose(-1, -2) @ v_new

    def stack(self) -> torch.Tensor:
        if self.stacked is None:
            self.stacked = torch.stack([self.at(i) for i in range(len(self))], dim=1)
        return self.stacked
