"""Train the DFlash2 drafter against the frozen target (``train --drafter dflash2``).

    cd tools && python -m train_reference.train --drafter dflash2 --init DIR --out DIR2 [...]

Same data as the DFlash drafter-only run (:func:`common.make_dataset`: the frozen target's own
greedy continuations of stdlib text windows, with its layer outputs at ``target_layer_ids`` as
context), same blocks (anchored at generated positions, randomly cut shorter so that K below
block_size - 1 drafts what it was trained on). The drafter starts as DIR's DFlash drafter
(:func:`dflash2.init_from_dflash`: body copied, convolutions at identity, selector edge term
zero), so step 0 drafts exactly as DFlash does; ``--warm`` continues from DIR's
dflash2.safetensors instead.

Loss = the body's per-slot cross-entropy against the target's greedy token (as DFlash) +
``--selector-weight`` x the selector's K-way cross-entropy over each slot's top-K candidates
(the LM head's scores of the slot's hidden state), the predecessor being the true previous
token (the anchor for slot 1): the walk's choice at slot j only matters when slots < j were
accepted, i.e. equal to the true tokens. Slots whose true token is not among the top-K add
nothing to the selector's loss. Weights exp(-(j-1)/gamma) per slot, as DFlash.

Writes DIR2/dflash2.safetensors (bf16, DFlash2 fields in its metadata) and copies DIR's
config.json, model.safetensors, drafter.safetensors and tokenizer.json byte for byte, so DIR2
is a complete weights directory; then the acceptance probe (dflash2 vs dflash at K=7 and 3 on
the code prompts, selector on and off).

The shipped dflash2.safetensors came from one run on an NVIDIA H200 GPU (2026-12-01, 442 s in all)::

    cd tools && python3 -m train_reference.train --drafter dflash2 \
        --init ../speccheck/reference/weights --out /tmp/d2 --device cuda --seq 288 \
        --gen-batch 1024 --gen-seconds 75 --batch 256 --anchors 32 --lr 2e-3 --minutes 4 --probe 6

(47,104 continuations x 288 tokens; 4,796 steps in 242 s). Its probe on the 6 code prompts:
dflash-k7 2.624 tokens/iteration, dflash2-k7 3.112 (1.19x), dflash2 selector off 2.693;
K=3: 2.367 / 2.601 / 2.397; all 6/6 outputs identical to the baseline.
"""
from __future__ import annotations

import shutil
import time

import numpy as np
import torch
import torch.nn.functional as F

from speccheck.reference.dflash2 import (DFLASH2_FILE, DFlash2Drafter, candidates, init_from_dflash,
                                         load_dflash2, save_dflash2, walk)

from .common import WEIGHTS_DIR, StepSchedule, block_hidden, drafter_data, log, sample_blocks


def dflash2_block_loss(d2: DFlash2Drafter, cfg, E, seq, aux, labels, anchors, lengths,
                       gamma: float):
    """Blocks [x_p, mask...] at ``anchors`` cut to ``lengths`` slots (see train.block_loss).
    Returns (body loss, selector loss, hidden [B,A,bs-1,H], labels [B,A,bs-1],
    valid [A,bs-1], logits [B,A,bs-1,V])."""
    B, A = seq.shape[0], anchors.shape[0]
    bs = cfg.drafter.block_size
    device = seq.device
    slot = torch.arange(bs, device=device)
    live = (slot[None, :] < lengths[:, None]).reshape(-1)
    hb, positions = block_hidden(d2, cfg, E, seq, aux, anchors, live)
    logits = F.linear(hb, E).float()
    tgt = labels[:, positions.view(A, bs)[:, :-1]]  # [B, A, L]
    valid = live.view(A, bs)[:, 1:]
    L = bs - 1
    w = torch.exp(-torch.arange(L, device=device, dtype=torch.float32) / gamma)
    wv = (w[None, :] * valid.float())[None].expand(B, A, L)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                         reduction="none").view(B, A, L)
    body = (ce * wv).sum() / wv.sum()

    sel = d2.candidate_selector
    K = sel.top_k
    ids = logits.detach().topk(K, dim=-1).indices  # [B, A, L, K]
    unary = logits.gather(-1, ids)
    prev = torch.cat([seq[:, anchors][..., None], tgt[..., :-1]], -1)  # true predecessors
    h = F.linear(hb, sel.hidden_projection.weight)  # [B, A, L, r]
    edge = torch.einsum("balr,balkr->balk", sel.predecessor_codebook[prev] * h,
                        sel.successor_codebook[ids])
    score = (unary + edge).float()
    hit = ids == tgt[..., None]
    wk = wv * hit.any(-1).float()
    sce = F.cross_entropy(score.reshape(-1, K), hit.float().argmax(-1).reshape(-1),
                          reduction="none").view(B, A, L)
    selector = (sce * wk).sum() / wk.sum().clamp(min=1.0)
    return body, selector, hb, tgt, valid, logits


@torch.no_grad()
def dflash2_eval(d2: DFlash2Drafter, cfg, E, data: dict, B: int, gen: torch.Generator,
                 autocast, n_batches: int = 8) -> dict:
    """Expected tokens/iteration (1 + mean accepted prefix) with the selector's walk (as
    drafted at inference: predecessors are the walked candidates) and with the per-slot
    argmax (DFlash's rule), for K = bs-1 and K = 3, on anchors over the generated part."""
    d2.eval()
    bs = cfg.drafter.block_size
    T = data["seq"].shape[1]
    res = {}
    for K in (bs - 1, 3):
        tpi = {"walk": 0.0, "argmax": 0.0}
        for _ in range(n_batches):
            rows = torch.randint(0, len(data["seq"]), (B,), generator=gen).to(E.device)
            lo = int(data["plen"][rows].max())
            anchors = torch.arange(lo, T - bs + 1, max(1, (T - bs + 1 - lo) // 16),
                                   device=E.device)
            lengths = torch.full_like(anchors, K + 1)
            seq = data["seq"][rows]
            with autocast():
                _, _, hb, tgt, _, logits = dflash2_block_loss(
                    d2, cfg, E, seq, data["aux"][rows], data["labels"][rows], anchors, lengths, 4.0)
            hb, tgt, logits = hb[:, :, :K].float(), tgt[:, :, :K], logits[:, :, :K]
            n = hb.shape[0] * hb.shape[1]
            ids, vals = candidates(logits.reshape(n, K, -1), d2.candidate_selector.top_k)
            scores = d2.candidate_selector.edge_scores(ids, vals, hb.reshape(n, K, -1),
                                                       seq[:, anchors].reshape(n))
            walked = ids.gather(-1, walk(scores)[..., None])[..., 0].view_as(tgt)
            for name, drafts in (("walk", walked), ("argmax", logits.argmax(-1))):
                ok = (drafts == tgt).long().cumprod(-1)
                tpi[name] += (1 + ok.sum(-1).float().mean().item()) / n_batches
        res[f"K={K}"] = {k: round(v, 3) for k, v in tpi.items()}
    d2.train()
    return res


def param_groups(d2: DFlash2Drafter, wd: float) -> list[dict]:
    """Weight decay on matrices, not on norms or the conv base kernels (identity = tap 0 is 1)."""
    decay, no_decay = [], []
    for name, p in d2.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and not name.endswith("base_kernel") else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def train_dflash2(a) -> int:
    from speccheck.reference.engine import load_networks

    init = a.init or WEIGHTS_DIR
    if not (init / "model.safetensors").is_file() or not (init / "drafter.safetensors").is_file():
        raise SystemExit(f"--drafter dflash2 needs --init DIR with a trained model.safetensors "
                         f"and drafter.safetensors; got {init}")
    if a.out.resolve() == init.resolve():
        raise SystemExit("--out must differ from --init: the init weights are read while "
                         "the output is written; copy the result over afterwards")
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg, target, _, drafter, _ = load_networks(init)
    if a.warm:
        d2 = load_dflash2(init / DFLASH2_FILE, cfg)
        log(f"dflash2: warm start from {init / DFLASH2_FILE}")
    else:
        d2 = DFlash2Drafter(cfg)
        init_from_dflash(d2, drafter, a.seed)
        log(f"dflash2: body from {init / 'drafter.safetensors'}, conv identity, selector edge 0")
    target = target.to(device, torch.bfloat16).eval().requires_grad_(False)
    d2 = d2.to(device).train()
    for name, p in d2.named_parameters():  # --train: what learns; the rest stays as initialised
        p.requires_grad_(name.startswith("candidate_selector.") or a.train == "all"
                         or ("_conv." in name and a.train == "conv+selector"))
    log(f"training {a.train}: {sum(p.numel() for p in d2.parameters() if p.requires_grad):,} "
        f"parameters")
    n_new = sum(p.numel() for n, p in d2.named_parameters()
                if "_conv." in n or n.startswith("candidate_selector."))
    log(f"params: dflash2 {sum(p.numel() for p in d2.parameters()):,} ({n_new:,} new)")
    E = target.embed_tokens.weight.detach().float()
    tok_path, data, held_d, gen, plens, autocast = drafter_data(a, init, cfg, target, device)
    T, bs = a.seq, cfg.drafter.block_size
    eval_b = min(64, len(held_d["seq"]))
    log(f"before: {dflash2_eval(d2, cfg, E, held_d, eval_b, torch.Generator().manual_seed(7), autocast)}")

    opt = torch.optim.AdamW(param_groups(d2, 0.01), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    by_plen = {P: (data["plen"] == P).nonzero()[:, 0] for P in plens}
    sched = StepSchedule(a.lr, warmup=50, floor=0.05, steps=a.steps, minutes=a.minutes, log=log)
    step = 0
    while step < sched.total:
        lr = sched.lr(step)
        for g in opt.param_groups:
            g["lr"] = lr
        rows, anchors, lengths = sample_blocks(by_plen, plens, step, a.batch, a.anchors, T, bs,
                                               gen, device)
        with autocast():
            body, selector, _, _, _, _ = dflash2_block_loss(
                d2, cfg, E, data["seq"][rows], data["aux"][rows], data["labels"][rows], anchors,
                lengths, a.gamma)
            loss = body + a.selector_weight * selector
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in d2.parameters() if p.requires_grad], 1.0)
        opt.step()
        step += 1
        if step % 200 == 0 or step == 1:
            log(f"step {step}/{sched.shown()} lr {lr:.2e} body {body.item():.3f} "
                f"selector {selector.item():.3f} ({time.time() - sched.t_start:.0f}s)")
    log(f"trained {step} steps x {a.batch} seqs x {a.anchors} blocks in "
        f"{time.time() - sched.t_start:.0f}s")
    log(f"after: {dflash2_eval(d2, cfg, E, held_d, eval_b, torch.Generator().manual_seed(7), autocast)}")

    a.out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json", "drafter.safetensors", "tokenizer.json"):
        src = init / name if (init / name).is_file() else tok_path
        shutil.copyfile(src, a.out / name)
    save_dflash2(d2, a.out / DFLASH2_FILE)
    log(f"saved {a.out / DFLASH2_FILE} ({(a.out / DFLASH2_FILE).stat().st_size / 1e6:.2f} MB); "
        f"model/config/drafter/tokenizer copied unchanged from {init}")
    if a.probe:
        dflash2_probe(a.out, a.device, a.probe, 96)
    return 0


def dflash2_probe(out, device: str, n_prompts: int, max_tokens: int) -> dict:
    """Tokens/iteration on the code prompts (bf16, greedy): dflash vs dflash2 (selector on and
    off) at K=7 and K=3; the last line is the acceptance verdict at K=7."""
    from speccheck.corpus import load_corpus
    from speccheck.reference.engine import ReferenceEngine
    from speccheck.types import SpecConfig

    prompts = [p for p in load_corpus("code").prompts][:n_prompts]
    prompts = [type(p)(p.id, p.category, max_tokens, p.text, p.messages) for p in prompts]
    res, base = {}, None
    for label, args in (("dflash", {}), ("dflash2", {}),
                        ("dflash2 selector=off", {"dflash2_selector": "off"})):
        eng = ReferenceEngine(str(out), {"device": device, **args})
        ids = [eng.tokenize(p) for p in prompts]
        base = base or eng.generate(prompts, ids, SpecConfig(), 5)
        for k in (7, 3):
            cs = eng.generate(prompts, ids, SpecConfig(label.split()[0], k), 5)
            tot = sum((c.spec for c in cs[1:]), cs[0].spec)
            tpi = 1 + tot.accepted_tokens / max(tot.drafts, 1)
            per = [round(x / max(tot.drafts, 1), 3) for x in tot.accepted_per_pos]
            same = sum(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(cs, base))
            log(f"probe {label} K={k}: tokens/iter {tpi:.3f}  per-pos {per}  identical {same}/{len(cs)}  "
                f"decode {sum(c.decode_s for c in cs):.2f}s")
            res[(label, k)] = tpi
    r = res[("dflash2", 7)] / res[("dflash", 7)]
    off = res[("dflash2 selector=off", 7)] / res[("dflash", 7)]
    log(f"ACCEPTANCE dflash2-k7 / dflash-k7 tokens/iter = {res[('dflash2', 7)]:.3f} / "
        f"{res[('dflash', 7)]:.3f} = {r:.3f} (goal >= 1.10); selector off: {off:.3f} "
        f"(goal within 0.98..1.02)")
    return res
