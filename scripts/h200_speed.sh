#!/usr/bin/env bash
# h200_speed.sh — the embedded engine's speed on one H200 (issue 13's 2.0x), from the repo root
# on the GPU box; each verb fits one device call (600 s) and writes what comes back to $OUT:
#
#   bash scripts/h200_speed.sh bench   the fastest engine's bench (Triton kernels, compiled graph
#       steps): baseline, MTP K=3, DFlash K=7, DFlash2 K=6,7, 3 rounds, prompt by prompt and
#       config by config (--order both), with the loop split (where each config's decode time
#       goes: the steps, the gaps between them, per generation) and each step graph's GPU time.
#       About 4 minutes. BENCH_ARGS replaces the config list; SPLIT=0 leaves the split's timing
#       events out (the run to quote: they add a few µs of host work a step).
#   bash scripts/h200_speed.sh train   the DFlash2 drafter trained further against the frozen
#       target (warm start from the shipped one, every weight, MINUTES of steps, default 5), its
#       acceptance probe, then dflash2.safetensors to $OUT; with BENCH=1 also the bench of
#       DFlash2 K=6,7 with it. Copy the file over speccheck/reference/weights/ only if
#       the probe's dflash2-k7 tokens/iteration beat the shipped drafter's, then re-record the
#       goldens (`speccheck golden record --force`, on the CPU).
set -euo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/h200-speed}
mkdir -p "$OUT"
cd "$R"
export PYTHONPATH=$R PYTHONUNBUFFERED=1
FAST=${FAST:-"--engine-arg device=cuda --engine-arg gdn_decode=fused --engine-arg gdn_verify=fused
  --engine-arg compile=on --engine-arg attn_decode=fused --engine-arg attn_verify=fused
  --engine-arg attn_draft=fused"}

bench() {  # bench LOG [config args]
  local log=$1; shift
  # shellcheck disable=SC2086
  local split=--loop-split
  [ "${SPLIT:-1}" = 0 ] && split=
  timeout 560 python3 benchmarks/bench_reference.py $FAST --repeats 3 --order both $split \
    "$@" > "$OUT/$log" 2>&1 || echo "bench exit $?" >> "$OUT/$log"
  grep -v "^    \|[Ww]arn" "$OUT/$log" | tail -60 || true
}

case "${1:-}" in
  bench)
    # shellcheck disable=SC2086
    bench bench.log ${BENCH_ARGS:---mtp-k 3 --dflash-k 7 --dflash2-k 6,7} ;;
  train)
    rm -rf /tmp/d2
    PYTHONPATH=tools timeout 560 python3 -m train_reference.train --drafter dflash2 --warm --train all \
      --init speccheck/reference/weights --out /tmp/d2 --device cuda --seq 288 \
      --gen-batch 1024 --gen-seconds 75 --batch 256 --anchors 32 --lr 1e-3 \
      --minutes "${MINUTES:-5}" --probe 6 2>&1 | tee "$OUT/train.log" | grep -v "^step " || true
    cp /tmp/d2/dflash2.safetensors "$OUT/"
    if [ "${BENCH:-0}" = 1 ]; then
      cp /tmp/d2/dflash2.safetensors speccheck/reference/weights/dflash2.safetensors
      bench bench-trained.log --mtp-k "" --dflash-k "" --dflash2-k 6,7
    fi ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
