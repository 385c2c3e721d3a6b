"""The target's sampling distribution at a sampled position, from the scorer's top-k raw
logprobs (and the tail mass they leave), as verify/sampled.py's test needs it.

Why here and not in an engine: the distribution a sampled token is tested against must not be
computed by the code under test. Every engine gives raw teacher-forced logprobs (the log-softmax
of the logits: vLLM's ``prompt_logprobs``, the reference engine's prefill scores); this module
applies the sampling transform itself, with vLLM's semantics -- temperature, then top-k (the
tokens ranked below k dropped), then top-p over the renormalised survivors (a token is kept
while the mass strictly before it is below p) -- so a temperature, top-k or top-p bug in an
engine's sampler shows as a mismatch instead of being reproduced by its own scorer.

With only the top k of V tokens the rest is lumped into one tail category, ordered last (each
tail token is less probable than every top-k one). Its mass under temperature T is bounded,
not known, unless T = 1: for the tail's raw mass R spread over N = V - k tokens, each at most
the smallest top-k probability r_k, the tempered tail weight sum(r_j ** (1/T)) lies between
R * r_k ** (1/T - 1) and N ** (1 - 1/T) * R ** (1/T) (in either order, as 1/T is above or below
1). A position is *identified* when its nucleus among the top k is the same at both ends of
that range and the sampling mass of the kept tail moves by at most :data:`TAIL_EPS`. Where it
is not, the top-k tokens that every nucleus in the range keeps still have exact relative
probabilities, so a draw that falls among them is tested against those alone (conditional on
falling there, it is a draw from them); a draw outside even the largest nucleus is a miss; any
other position is left out (a NaN row). Which of these a position is rests on its prefix's
distribution and on which of those prefix-determined sets the draw fell in, so each row's PIT
is uniform given everything before it and the tests stay exact.
"""
from __future__ import annotations

import numpy as np

#: how far the tail's sampling mass may be uncertain at an identified position (its midpoint
#: is used): a systematic error of at most half this on the PIT of a tail draw
TAIL_EPS = 1e-4
#: nucleus mass by which a sampled token may miss the scorer's nucleus and count as a
#: boundary case of kernel numerics (its row carries minus the excess), not as outside the
#: support
BOUNDARY_MASS = 0.01
#: raw logprob difference within which two tokens' order may differ between the path that
#: sampled and the scorer's (the reference engine's bf16 path noise is about 0.015 nats)
BOUNDARY_NATS = 0.05


def sampled_rows(topk_ids: np.ndarray, topk_logprobs: np.ndarray, tokens: np.ndarray,
                 temperature: float, top_p: float = 1.0, top_k: int = 0,
                 vocab_size: int | None = None,
                 token_logprobs: np.ndarray | None = None) -> np.ndarray:
    """Per sampled position, float64 [n, 6]: the sampling mass of the categories strictly more
    probable than the sampled token's, the mass of its own category (the tokens tied with it,
    or the tail), its category's probability, E[log p] and E[(log p)^2] over the categories
    -- under temperature / top-k / top-p applied to the raw logprobs ``topk_logprobs``
    ([n, k], -inf pads a short row) of the tokens ``topk_ids`` -- and 1 where the row is
    conditional: the nucleus is not identified but the token is among the top-k tokens every
    possible nucleus keeps, and the row is over those alone.

    The probability column is 0 for a token the sampler never draws, minus the nucleus excess
    for one just outside the nucleus (< BOUNDARY_MASS, counting only the tokens more than
    BOUNDARY_NATS more probable; ``token_logprobs``, the sampled tokens' raw logprobs, place
    a tail token), and the whole row is NaN where the top-k does not identify the distribution
    and the row is neither conditional nor a sure miss (see the module)."""
    ids = np.asarray(topk_ids, dtype=np.int64)
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
    n = len(tok)
    if n == 0:
        return np.zeros((0, 6))
    ids, lp = ids.reshape(n, -1), lp.reshape(n, -1)
    k = ids.shape[1]
    lp = np.where(np.isfinite(lp), lp, -np.inf)
    # canonical order: logprob descending, ties by lowest id (as greedy argmax breaks them)
    order = np.lexsort((ids, -lp), axis=-1)
    ids, lp = np.take_along_axis(ids, order, 1), np.take_along_axis(lp, order, 1)
    valid = np.isfinite(lp)
    kv = valid.sum(1)
    a = 1.0 / float(temperature)
    lp1 = np.where(kv > 0, lp[:, 0], 0.0)
    raw = np.where(valid, np.exp(lp), 0.0)
    tail = np.clip(1.0 - raw.sum(1), 0.0, None)
    if vocab_size is not None:
        tail = np.where(kv >= vocab_size, 0.0, tail)
    rank = np.arange(k)[None, :]
    w = np.where(valid, np.exp(a * (lp - lp1[:, None])), 0.0)  # tempered, in units of the top-1's
    tail_open = np.ones(n, bool)  # the sampler's top-k may reach past the scored top-k
    if top_k and top_k > 0:
        w = np.where(rank < top_k, w, 0.0)
        tail_open = kv < top_k
    s = w.sum(1)
    # the tempered tail weight's bounds (module docstring), same units as w
    lp_min = np.where(kv > 0, lp[np.arange(n), np.maximum(kv - 1, 0)], 0.0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        log_r = np.log(np.where(tail > 0, tail, 1.0))
        near = np.exp(log_r + (a - 1.0) * lp_min - a * lp1)  # R r_k^(a-1)
        if vocab_size is not None:
            spread = np.exp((1.0 - a) * np.log(np.maximum(vocab_size - kv, 1)) + a * log_r - a * lp1)
        else:
            spread = np.full(n, 0.0 if a > 1 else np.inf)
    if a == 1.0:
        lo = hi = tail / np.exp(lp1)
    elif a > 1.0:
        lo, hi = spread, near
    else:
        lo, hi = near, spread
    lo = np.where(tail_open, lo, 0.0)
    hi = np.where(tail_open, hi, 0.0)
    lo = np.where(tail > 0, lo, 0.0)
    hi = np.where(tail > 0, hi, 0.0)
    if top_k and top_k > 0:
        lo = np.where(kv < top_k, 0.0, lo)  # only part of the tail may be kept: no lower bound
    z_lo, z_hi = s + lo, s + hi
    before = np.cumsum(w, 1) - w
    alive = valid & (w > 0)
    p = float(top_p)
    if p >= 1.0:
        kept_lo = kept_hi = alive
        t_min, t_max = lo, hi
    else:
        with np.errstate(invalid="ignore"):
            kept_lo = alive & (before < p * z_lo[:, None])
            kept_hi = alive & (before < p * z_hi[:, None])
        w_last = np.exp(a * (lp_min - lp1))  # no tail token weighs more than the last top-k one
        with np.errstate(invalid="ignore"):
            t_min = np.where(s < p * z_lo, np.minimum(lo, p * z_lo - s), 0.0)
            t_max = np.where(s < p * z_hi, np.minimum(hi, p * z_hi - s + w_last), 0.0)
        t_min, t_max = np.clip(t_min, 0.0, None), np.clip(t_max, 0.0, None)
    wk = (w * kept_hi).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        pi_min = np.where(t_min > 0, t_min / (wk + t_min), 0.0)
        pi_max = np.where(np.isinf(t_max), 1.0, np.where(t_max > 0, t_max / (wk + t_max), 0.0))
    identified = (kept_lo == kept_hi).all(1) & (pi_max - pi_min <= TAIL_EPS) & (kv > 0)
    pi_t = np.where(identified, (pi_min + pi_max) / 2, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        pi = np.where(kept_hi, w / np.where(wk > 0, wk, 1.0)[:, None], 0.0) * (1.0 - pi_t)[:, None]
    # the sampled token's category
    hit = (ids == tok[:, None]) & valid
    in_top = hit.any(1)
    at = hit.argmax(1)
    rows = np.arange(n)
    lp_x = np.where(in_top, lp[rows, at], -np.inf)
    p_x = np.where(in_top, pi[rows, at], pi_t)
    above = np.where(in_top, (pi * (lp > lp_x[:, None])).sum(1), 1.0 - pi_t)
    tied = np.where(in_top, (pi * (lp == lp_x[:, None])).sum(1), pi_t)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(pi > 0, np.log(np.where(pi > 0, pi, 1.0)), 0.0)
        lt = np.where(pi_t > 0, np.log(np.where(pi_t > 0, pi_t, 1.0)), 0.0)
    m1 = (pi * logs).sum(1) + pi_t * lt
    m2 = (pi * logs * logs).sum(1) + pi_t * lt * lt
    # just outside the nucleus (top-p, not top-k): a boundary case of numerics, not a miss.
    # Tokens within BOUNDARY_NATS of the sampled one may be ordered either way on the path
    # that sampled it, so only the clearly more probable ones count as before it.
    if p < 1.0:
        own = lp_x
        if token_logprobs is not None:
            own = np.where(in_top, lp_x, np.asarray(token_logprobs, np.float64).reshape(-1))
        own = np.where(np.isfinite(own), own, lp_min)
        clearly = (w * (lp > own[:, None] + BOUNDARY_NATS)).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mass_before = clearly / np.where(z_hi > 0, z_hi, 1.0)
        by_rank = np.where(in_top, (at < top_k) if top_k else True, tail_open)
        excess = mass_before - p
        edge = (p_x <= 0) & by_rank & (excess < BOUNDARY_MASS)
        p_x = np.where(edge, -np.maximum(excess, 1e-12), p_x)
    out = np.stack([above, tied, p_x, m1, m2, np.zeros(n)], 1)
    # where the nucleus is not identified: a token outside even the largest nucleus the bounds
    # allow is still a miss; a token among the top-k that every nucleus keeps is tested within
    # them, against w / sum(w) over that set (exact whatever the tail: conditional on the
    # draw falling there, a prefix-determined set, it is a draw from that)
    sure = kept_lo & alive
    w_a = (w * sure).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        pa = np.where(sure, w / np.where(w_a > 0, w_a, 1.0)[:, None], 0.0)
        la = np.where(pa > 0, np.log(np.where(pa > 0, pa, 1.0)), 0.0)
    within = ~identified & in_top & sure[rows, at] & (kv > 0)
    cond = np.stack([(pa * (lp > lp_x[:, None])).sum(1), (pa * (lp == lp_x[:, None])).sum(1),
                     pa[rows, at], (pa * la).sum(1), (pa * la * la).sum(1), np.ones(n)], 1)
    out[within] = cond[within]
    miss = ~identified & (kv > 0) & np.where(in_top, ~kept_hi[rows, at], t_max <= 0)
    out[~identified & ~within & ~miss] = np.nan
    return out


def identified_share(rows: np.ndarray) -> float:
    """Share of positions whose distribution the top-k identified (1.0 for none)."""
    return float(np.mean(~np.isnan(rows[:, 2]))) if len(rows) else 1.0


def transform_full(logprobs: np.ndarray, temperature: float, top_p: float = 1.0,
                   top_k: int = 0) -> np.ndarray:
    """The sampling distribution over a whole vocabulary ([..., V] raw logprobs -> probabilities),
    vLLM's order (temperature, top-k, top-p over the renormalised survivors; ties by lowest id):
    the reference for tests, and for engines that hand over full rows."""
    x = np.asarray(logprobs, dtype=np.float64) / float(temperature)
    x = x - x.max(-1, keepdims=True)
    w = np.exp(x)
    order = np.argsort(-x, axis=-1, kind="stable")
    ws = np.take_along_axis(w, order, -1)
    keep = np.ones_like(ws, bool)
    if top_k and top_k > 0:
        keep[..., top_k:] = False
    ws = ws * keep
    if top_p < 1.0:
        tot = ws.sum(-1, keepdims=True)
        keep &= (np.cumsum(ws, -1) - ws) < top_p * tot
    out = np.zeros_like(w)
    np.put_along_axis(out, order, np.where(keep, ws, 0.0), -1)
    return out / out.sum(-1, keepdims=True)
