"""What the reference engine's trainings share (train.py: the joint run and the DFlash
drafter-only run; train_dflash2.py: the DFlash2 drafter): the step schedule, the token stream
and its batches, the drafter's block forward, and the drafter-only data, the frozen target's
greedy continuations of text windows.

The drafter is accepted when it predicts what the *target* will emit next, and at inference
its context is the target's own greedy continuation, not human text. So the frozen target
first writes greedy continuations of text windows (batched, through the same cached decode
path the engine uses, in bf16 like the engine); one full forward over each finished sequence
gives the context features (layer outputs at ``target_layer_ids``) and the labels (the
target's argmax at every position). The drafter then trains on blocks anchored at every
generated position: for a block at p the context is positions < p (as decode.py feeds it)
and slot j is labelled with the target's argmax at p+j-1, which is the next token of the
greedy sequence. Blocks are randomly cut shorter (slots past the cut are neither seen nor
scored) so that K < block_size - 1 drafts what it was trained on.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from speccheck.reference.dflash2 import DFlash2Drafter
from speccheck.reference.engine import WEIGHTS_DIR
from speccheck.reference.model import Cache, DFlashDrafter, Qwen3_5TextModel, ReferenceConfig

__all__ = ["WEIGHTS_DIR", "StepSchedule", "autocast_for", "batch", "block_hidden", "drafter_data",
           "features", "greedy_continue", "log", "make_dataset", "sample_blocks", "token_stream"]


class StepSchedule:
    """Warm-up + cosine learning rate over a step count that is either given (``--steps``) or
    fitted to a time budget (``--minutes``) from the speed of steps 10..40."""

    def __init__(self, base_lr: float, warmup: int, floor: float, steps: int, minutes: float, log) -> None:
        self.base_lr, self.warmup, self.floor, self.log = base_lr, warmup, floor, log
        self.fixed = bool(steps)
        self.total = steps or 10**9
        self.budget = minutes * 60
        self.t_start = time.time()
        self.t10 = 0.0

    def lr(self, step: int) -> float:
        """Called once per step, before it: also refits the step count at step 40."""
        if not self.fixed and step == 10:
            self.t10 = time.time()
        if not self.fixed and step == 40:
            per = (time.time() - self.t10) / 30
            self.total = max(60, int((self.budget - (self.t10 - self.t_start)) / per))
            self.log(f"{per * 1000:.0f} ms/step -> {self.total} steps in {self.budget / 60:g} min")
        frac = step / max(self.total, 1) if self.total < 10**9 else 0.0
        cosine = 0.5 * (1 + math.cos(math.pi * frac))
        return self.base_lr * min(1.0, (step + 1) / self.warmup) * (self.floor + (1 - self.floor) * cosine)

    def shown(self) -> str:
        return str(self.total) if self.total < 10**9 else "?"


def log(*a) -> None:
    print(*a, flush=True)


def token_stream(texts: list[str], tok, eos: int) -> np.ndarray:
    """All texts tokenised and joined with <|endoftext|> into one int32 stream."""
    out = []
    for enc in tok.encode_batch(texts):
        out.append(np.asarray(enc.ids, dtype=np.int32))
        out.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(out)


def batch(stream: np.ndarray, B: int, T: int, gen: torch.Generator, device) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - T - 2, (B,), generator=gen).numpy()
    idx = starts[:, None] + np.arange(T + 1)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64)).to(device)


def block_hidden(drafter: DFlashDrafter, cfg: ReferenceConfig, E: torch.Tensor, seq: torch.Tensor,
                 aux: torch.Tensor, anchors: torch.Tensor, live: torch.Tensor | None = None):
    """Drafter hidden states of blocks [x_p, mask, ...] at ``anchors`` (shared by the batch), fed as
    decode.py feeds them: context = target features at positions < p, attention non-causal inside
    a block (over its ``live`` slots only, when given). Returns (hidden of slots 1.. [B, A, bs-1, H],
    positions [A*bs])."""
    B, T = aux.shape[0], aux.shape[1]
    A = anchors.shape[0]
    bs = cfg.drafter.block_size
    device = seq.device
    slot = torch.arange(bs, device=device)
    positions = (anchors[:, None] + slot[None, :]).reshape(-1)  # [A*bs]
    block = torch.full((B, A, bs), cfg.mask_token_id, dtype=torch.long, device=device)
    block[:, :, 0] = seq[:, anchors]
    emb = F.embedding(block.reshape(B, -1), E)
    ctx_kv = drafter.context_kv(aux, torch.arange(T, device=device))
    ctx_ok = torch.arange(T, device=device)[None, :] < anchors.repeat_interleave(bs)[:, None]
    blk = torch.arange(A, device=device).repeat_interleave(bs)
    blk_ok = blk[:, None] == blk[None, :]
    if live is not None:
        blk_ok = blk_ok & live[None, :]
    mask = torch.cat([ctx_ok, blk_ok], 1)  # [Q, T+Q]
    conv_blocks = {"block_size": bs} if isinstance(drafter, DFlash2Drafter) else {}
    hb = drafter(emb, positions, ctx_kv, mask, **conv_blocks)
    return hb.view(B, A, bs, -1)[:, :, 1:], positions


@torch.no_grad()
def greedy_continue(target: Qwen3_5TextModel, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """[B, P] prompts -> [B, P + n_new]: batched greedy decoding with the engine's default
    kernel forms (chunked prefill, recurrent one-token decode)."""
    B, P = prompts.shape
    cache = Cache(len(target.layers), P + n_new + 1)
    h, _ = target(prompts, cache, gdn_form="chunked", attn_form="multi")
    out = [prompts, target.logits(h[:, -1:]).argmax(-1)]
    for _ in range(n_new - 1):
        h, _ = target(out[-1], cache, gdn_form="recurrent", attn_form="multi")
        out.append(target.logits(h[:, -1:]).argmax(-1))
    return torch.cat(out, 1)


@torch.no_grad()
def features(target: Qwen3_5TextModel, cfg: ReferenceConfig, seqs: torch.Tensor):
    """(aux [B,T,n*H] bf16, labels [B,T]): concatenated target layer outputs at
    ``target_layer_ids`` and the target's argmax at every position (position t predicts
    token t+1), from one full (training-path) forward."""
    ids = tuple(cfg.drafter.target_layer_ids)
    h, aux = target(seqs, aux_layers=ids)
    return (torch.cat([aux[i] for i in ids], -1).to(torch.bfloat16),
            target.logits(h).argmax(-1))


def make_dataset(target, cfg, stream: np.ndarray, T: int, prompt_lens: list[int], B: int,
                 seconds: float, gen: torch.Generator, device, min_batches: int = 1) -> dict:
    """Greedy continuations of random text windows: ``min_batches`` batches, and more until
    ``seconds`` pass (a time budget makes the amount machine-dependent). Every sequence
    has T tokens: a text prompt of P tokens (cycling through ``prompt_lens``) and T-P
    greedy tokens. Returns {"seq", "aux", "labels", "plen"} (row-aligned)."""
    seqs, auxs, labels, plens = [], [], [], []
    t0 = time.time()
    i = 0
    while i < min_batches or time.time() - t0 < seconds:
        P = prompt_lens[i % len(prompt_lens)]
        prompt = batch(stream, B, P - 1, gen, device)  # [B, P]
        s = greedy_continue(target, prompt, T - P)
        a, lab = features(target, cfg, s)
        seqs.append(s)
        auxs.append(a)
        labels.append(lab)
        plens.append(torch.full((B,), P, device=device))
        i += 1
    d = {"seq": torch.cat(seqs), "aux": torch.cat(auxs), "labels": torch.cat(labels),
         "plen": torch.cat(plens)}
    agree = (d["labels"][:, :-1] == d["seq"][:, 1:]).float()
    gen_part = torch.arange(T - 1, device=device)[None, :] >= d["plen"][:, None] - 1
    log(f"generated {i} batches = {len(d['seq'])} sequences x {T} tokens in "
        f"{time.time() - t0:.1f}s; full-forward argmax == greedy token on "
        f"{agree[gen_part].mean().item():.4f} of generated positions")
    return d


def sample_blocks(by_plen: dict, plens: list[int], step: int, batch: int, n_anchors: int,
                  T: int, bs: int, gen: torch.Generator, device):
    """One training batch of drafter blocks: ``batch`` sequences of one prompt length (by
    turns), ``n_anchors`` anchors at generated positions, and block lengths that are the full
    block half of the time and a random cut (2..bs) otherwise, so that K below bs - 1 drafts
    what it was trained on. Returns (rows, anchors, lengths)."""
    P = plens[step % len(plens)]
    pool = by_plen[P]
    rows = pool[torch.randint(0, len(pool), (batch,), generator=gen).to(device)]
    anchors = (P + torch.randperm(T - bs + 1 - P, generator=gen)[:n_anchors]).to(device)
    cut = torch.randint(2, bs + 1, (len(anchors),), generator=gen)
    full = torch.rand(len(anchors), generator=gen) < 0.5
    return rows, anchors, torch.where(full, bs, cut).to(device)


def drafter_data(a, init: Path, cfg: ReferenceConfig, target, device):
    """What both drafter-only trainings (DFlash, DFlash2) learn from: the frozen target's
    greedy continuations of stdlib text (train and held-out), generated here. Returns
    (tokenizer path, train data, held-out data, generator, prompt lengths, autocast)."""
    from tokenizers import Tokenizer

    from .data import held_out_split, training_texts

    tok_path = init / "tokenizer.json" if (init / "tokenizer.json").is_file() \
        else WEIGHTS_DIR / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path))
    t0 = time.time()
    train_texts, held_texts = held_out_split(training_texts(a.max_bytes))
    train = token_stream(train_texts, tok, cfg.eos_token_id)
    held = token_stream(held_texts, tok, cfg.eos_token_id) if held_texts else train[-200_000:]
    log(f"data: {len(train):,} train / {len(held):,} held-out tokens ({time.time() - t0:.1f}s)")
    gen = torch.Generator().manual_seed(a.seed + 1)
    plens = [int(x) for x in a.prompt_lens.split(",")]
    T = a.seq
    if max(plens) > T - cfg.drafter.block_size - 1:
        raise SystemExit(f"--prompt-lens {a.prompt_lens}: each must be < --seq {T} minus "
                         f"block_size+1 so that blocks fit in the generated part")
    autocast = autocast_for(device)
    held_d = make_dataset(target, cfg, held, T, plens, a.gen_batch, 0, gen, device,
                          min_batches=len(plens))
    data = make_dataset(target, cfg, train, T, plens, a.gen_batch,
                        0 if a.gen_batches else a.gen_seconds, gen, device,
                        min_batches=a.gen_batches or len(plens))
    return tok_path, data, held_d, gen, plens, autocast


def autocast_for(device: torch.device):
    """The trainings' autocast: bf16 on CUDA, a no-op elsewhere (a function to call per use)."""
    use_amp = device.type == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp)

    return autocast
