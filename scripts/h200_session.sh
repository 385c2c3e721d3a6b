#!/usr/bin/env bash
# h200_session.sh — one device lease's GPU evidence as background jobs (setsid: they outlive
# each device call while the machine is held), from the repo root on the GPU box:
#
#   bash scripts/h200_session.sh prep    needs nothing staged: exports the reference checkpoint
#       padded to GDN head dim 128 (the shape FlashInfer's SM90 kernel takes) and runs the
#       embedded engine's benchmark on CUDA. Start it in the first staging call.
#   bash scripts/h200_session.sh go      after the last `h200_vllm.sh unpack`: doctor; kernels
#       gdn (FLA, FlashInfer, vLLM's fused kernels vs fp64); the offline vLLM matrix with vLLM's
#       own defaults (CUDA graphs, its GDN prefill backend) and attribution (h200_vllm.sh run);
#       beside it the same settings through vLLM's OpenAI server, baseline then MTP K=3 on
#       one URL (h200_server.sh sameurl); then baselines with one kernel switch flipped each
#       (FLIPS), to check that attribution named the right switch.
#   bash scripts/h200_session.sh wait S  waits up to S seconds (until every job ended), prints
#       each job's state and log tail, and packs what exists into $OUT/session.tgz.
set -uo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/h200-out}
JOBS=${JOBS:-/tmp/speccheck-jobs}
CKPT=${CKPT:-/tmp/speccheck-ckpt128}
WORK=${WORK:-/tmp/speccheck-h200}
SITE=${SITE:-/root/site}
CORPUS=${CORPUS:-smoke+code+.stage/data/question.jsonl}
FLIPS=${FLIPS:-"env.VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0 enforce_eager=true"}
mkdir -p "$OUT" "$JOBS" "$WORK"
cd "$R" || exit 2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false

bg() {  # bg NAME COMMAND: run COMMAND in its own session, log to $JOBS/NAME.log, rc to NAME.rc
  local name=$1; shift
  rm -f "$JOBS/$name.rc"
  setsid nohup bash -c "$* ; echo \$? > '$JOBS/$name.rc'" > "$JOBS/$name.log" 2>&1 < /dev/null &
  echo "started $name (pid $!)"
}

prep() {
  bg export "python3 -m speccheck.cli export-reference $CKPT --linear-head-dim 128"
  bg bench "python3 benchmarks/bench_reference.py --engine-arg device=cuda --repeats 5 \
            --mtp-k 1,3,5,7 --dflash-k 5,7,8"
}

go() {
  # FlashInfer finds CuTe-DSL through a .pth file, which Python does not read on PYTHONPATH
  local env="PYTHONPATH=$R:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$WORK/pydeps"
  bg doctor "$env python3 -m speccheck.cli doctor --engine vllm --model $CKPT/target --k 7; \
             $env python3 -m speccheck.cli doctor --engine vllm --model $CKPT/target --k 7 --tp 2"
  bg kernels "$env python3 -m speccheck.cli kernels gdn --device cuda --positions 4096 --head-dim 128 \
              --json $JOBS/kernels.json; $env python3 -m speccheck.cli kernels gdn --device cuda \
              --positions 4096 --head-dim 64 --json $JOBS/kernels64.json"
  # the offline matrix; room left on the GPU for the server beside it
  bg offline "until [ -f $JOBS/export.rc ]; do sleep 2; done; CORPUS=$CORPUS GPU_UTIL=0.25 \
     CONFIGS='mtp-k1 mtp-k3 mtp-k7 dflash-k7' ATTENTION=TRITON_ATTN DEADLINE_S=${DEADLINE_S:-1300} CAPTURE=0 \
     ATTRIBUTION_PATHS='${ATTRIBUTION_PATHS:-decode*,verify*,prefill gdn=*}' OUT=$JOBS/offline \
     WORK=$WORK bash scripts/h200_vllm.sh run $CKPT"
  # the server, once the offline baseline has shown which GDN prefill backend runs here
  bg server "until [ -f $WORK/gdn_prefill_used ] || [ -f $JOBS/offline.rc ]; do sleep 3; done; \
     k='--attention-backend TRITON_ATTN'; \
     [ \"\$(cat $WORK/gdn_prefill_used 2>/dev/null)\" = triton ] && \
       k=\"\$k --additional-config {\\\"gdn_prefill_backend\\\":\\\"triton\\\"}\"; \
     SERVER_KERNELS=\"\$k\" CKPT=$CKPT CORPUS=$CORPUS OFFLINE_STORE=$WORK/store WORK=/tmp/speccheck-srv \
     OUT=$JOBS/server bash scripts/h200_server.sh sameurl"
  # once the offline matrix is generated (its attribution running): one switch flipped per
  # baseline run, same corpus and settings otherwise
  bg flips "until grep -q '^attribution: ' $JOBS/offline.log || [ -f $JOBS/offline.rc ]; do sleep 3; done; i=0; for f in $FLIPS; do i=\$((i+1)); \
     echo \"== flip \$f\"; CORPUS=$CORPUS GPU_UTIL=0.25 CONFIGS='' ATTENTION=TRITON_ATTN \
     DEADLINE_S=300 CAPTURE=0 REPEATS=1 RUN_ARGS='--concurrent 0 --no-attribution' OUT=$JOBS/flip\$i WORK=/tmp/speccheck-flip\$i EXTRA_ARGS=\"--engine-arg \$f\" \
     bash scripts/h200_vllm.sh run $CKPT; done"
}

wait_jobs() {
  local limit=${1:-500} t=0
  while [ "$t" -lt "$limit" ]; do
    local running=0
    for l in "$JOBS"/*.log; do [ -f "${l%.log}.rc" ] || running=1; done
    [ "$running" = 0 ] && break
    sleep 10; t=$((t + 10))
  done
  for l in "$JOBS"/*.log; do
    local n; n=$(basename "$l" .log)
    echo "===== $n: $( [ -f "$JOBS/$n.rc" ] && echo "exit $(cat "$JOBS/$n.rc")" || echo running)"
    tail -n "${TAIL:-12}" "$l"
  done
  tar czf "$OUT/session.tgz" --exclude='*.safetensors' -C / "${JOBS#/}" "${WORK#/}" \
    tmp/speccheck-srv tmp/speccheck-flip1 tmp/speccheck-flip2 2>/dev/null
  ls -la "$OUT"
}

case "${1:-}" in
  prep) prep ;;
  go) go ;;
  wait) shift; wait_jobs "$@" ;;
  *) sed -n 2,19p "$0"; exit 2 ;;
esac
