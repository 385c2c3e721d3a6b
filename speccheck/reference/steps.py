"""What a generation is made of, shared by the eager loops (decode.py) and the CUDA-graph
step loops (graphs.py): the finished :class:`Generation`, the :class:`_Out` that collects a
sequence's tokens until a stop, :func:`emitted_rows` (what is stored per emitted token) and
:func:`_sync`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from speccheck.types import SpecCounters
from speccheck.verify.ties import canonical_rows


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    topk_ids: np.ndarray  # [n, k]
    topk_logprobs: np.ndarray  # [n, k]
    finish_reason: str
    ttft_s: float
    decode_s: float
    spec: SpecCounters | None = None
    iterations: int = 0  # target forwards after the prefill: verify steps, with or without a draft
    decode_cpu_s: float | None = None  # the process's CPU seconds of decode_s (on one CPU thread)


@dataclass
class _Out:
    """Accumulates generated tokens with their target distributions until a stop; one
    :meth:`add` is one step's tokens, cut at the first stop (faults ``past-max-tokens`` and
    ``past-eos`` turn a cut off: the rest of that step is emitted too)."""

    max_tokens: int
    eos: int
    top_k: int
    cut_at_max: bool = True
    cut_at_eos: bool = True
    tokens: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tk_ids: list[np.ndarray] = field(default_factory=list)
    tk_lps: list[np.ndarray] = field(default_factory=list)
    finish: str | None = None
    ignore_eos: bool = False  # decode the full max_tokens past end-of-sequence
    #: called with each step's emitted (tokens, logprobs, top-k ids, top-k logprobs) as lists,
    #: as soon as the step is decided (a server streams them)
    emit: Callable[[list, list, list, list], None] | None = None

    def add(self, tokens: list[int], rows: torch.Tensor) -> None:
        """tokens[i] was emitted from log-prob row rows[i] (fp32 [n, V])."""
        self.extend(tokens, *emitted_rows(rows, tokens, self.top_k))

    def extend(self, tokens: list[int], idx: np.ndarray, vals: np.ndarray,
               chosen: np.ndarray) -> None:
        """As :meth:`add`, from :func:`emitted_rows`' arrays (a batch computes them at once);
        what it keeps goes to ``emit`` at once."""
        n = len(self.tokens)
        self._extend(tokens, idx, vals, chosen)
        if self.emit is not None and len(self.tokens) > n:
            self.emit(self.tokens[n:], self.lps[n:], [r.tolist() for r in self.tk_ids[n:]],
                      [r.tolist() for r in self.tk_lps[n:]])

    def _extend(self, tokens: list[int], idx: np.ndarray, vals: np.ndarray,
                chosen: np.ndarray) -> None:
        if self.finish is not None:
            return
        for i, t in enumerate(tokens):
            self.tokens.append(int(t))
            self.lps.append(float(chosen[i]))
            self.tk_ids.append(idx[i])
            self.tk_lps.append(vals[i])
            if self.finish is None and t == self.eos and not self.ignore_eos:
                self.finish = "stop"
            elif self.finish is None and len(self.tokens) >= self.max_tokens:
                self.finish = "length"
            if (self.finish == "stop" and self.cut_at_eos) or \
                    (self.finish == "length" and self.cut_at_max):
                return


def emitted_rows(rows: torch.Tensor, tokens: list[int], top_k: int) -> tuple:
    """Host copies of what is stored per emitted token: the canonical top-k (ids, logprobs)
    of each log-prob row [n, V] and the logprob of tokens[i] in row i."""
    vals, idx = rows.topk(top_k, dim=-1)
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]
    idx, vals = canonical_rows(idx.cpu().numpy(), vals.cpu().numpy())
    return idx, vals, chosen.cpu().numpy()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
