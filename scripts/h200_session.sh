#!/usr/bin/env bash
# h200_session.sh — one device lease's GPU evidence as background jobs (setsid: they outlive
# each device call while the machine is held), from the repo root on the GPU box:
#
#   bash scripts/h200_session.sh prep    needs nothing staged: exports the reference checkpoint
#       padded to GDN head dim 128 (the shape FlashInfer's SM90 kernel takes); with BENCH=1
#       runs the embedded engine's benchmark on CUDA instead (alone: its timings need the GPU
#       to themselves). Start it in the first staging call.
#   bash scripts/h200_session.sh go      after the last `h200_vllm.sh unpack`: the jobs in
#       GO_JOBS (default: kernels matrix). kernels: gdn kernels (FLA, FlashInfer, vLLM's fused
#       kernels, the reference engine's fused Triton kernel) vs fp64. matrix: the offline vLLM
#       matrix with vLLM's own defaults (CUDA graphs, its GDN prefill backend) as one store per
#       spec config, side by side on the GPU (baseline + that config each), merged into one
#       suite (`speccheck merge`), then attribution by rerun over every config at once
#       (ATTRIBUTION_JOBS switches at a time). Older jobs: doctor; offline (the matrix in one
#       store, attribution as ATTRIBUTION_MODE says); server (the same settings through
#       vLLM's OpenAI server, baseline then MTP K=3 on one URL); flips (baselines with one
#       kernel switch flipped each); golden (smoke+code alone for golden/vllm); bench (the
#       embedded engine on CUDA once server/flips/golden end).
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
  if [ "${BENCH:-0}" = 1 ]; then  # before the vLLM jobs, so that its timings mean something
    bg bench "PYTHONPATH=$R python3 benchmarks/bench_reference.py --engine-arg device=cuda ${BENCH_ARGS:-$GPU_BENCH}"
  fi
}

# the embedded engine on CUDA: its CUDA-graph steps (default), with the fused Triton GDN kernel
# for decode and verify, and eager, in the same rounds
GPU_BENCH="--mtp-k 1,2,3 --dflash-k 5,7 --dflash2-k 5,7 --variant fused:gdn_decode=fused,gdn_verify=fused --variant eager:cuda_graphs=off --kernels 12"
# FlashInfer finds CuTe-DSL through a .pth file, which Python does not read on PYTHONPATH
PYENV="$R:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$WORK/pydeps"
ATTRIBUTION_PATHS=${ATTRIBUTION_PATHS:-decode,decode gdn=*,decode eager,verify mtp-k3,verify dflash-k7,prefill gdn=*}

gdn_used() { cat "$WORK/gdn_prefill_used" 2>/dev/null; }  # written by h200_vllm.sh run

job_doctor() {
  until [ -f "$JOBS/export.rc" ]; do sleep 2; done
  local target=$CKPT; [ -f "$CKPT/target/config.json" ] && target=$CKPT/target
  for tp in 1 2; do PYTHONPATH=$PYENV python3 -m speccheck.cli doctor --engine vllm --model "$target" --k 7 --tp $tp; done
}

job_kernels() {
  for d in 128 64; do
    PYTHONPATH=$PYENV python3 -m speccheck.cli kernels gdn --device cuda --positions 4096 --head-dim $d \
      --json "$JOBS/kernels$d.json"
  done
}

job_offline() {  # the matrix with vLLM's defaults; GPU_UTIL leaves room for the server beside it
  until [ -f "$JOBS/export.rc" ]; do sleep 2; done
  CORPUS=$CORPUS GPU_UTIL=0.25 CONFIGS='mtp-k1 mtp-k3 mtp-k7 dflash-k7' ATTENTION=TRITON_ATTN \
    DEADLINE_S=${DEADLINE_S:-1000} CAPTURE=0 ATTRIBUTION_PATHS=$ATTRIBUTION_PATHS OUT=$JOBS/offline \
    WORK=$WORK bash scripts/h200_vllm.sh run "$CKPT"
}

job_matrix() {  # one store per spec config (baseline + it), side by side on the GPU; merged;
  # then attribution by rerun over all of them at once (every switch a worker of its own)
  until [ -f "$JOBS/export.rc" ]; do sleep 2; done
  local configs=${MATRIX_CONFIGS:-mtp-k1 mtp-k3 mtp-k7 dflash-k7} c first=1
  for c in $configs; do
    CORPUS=$CORPUS GPU_UTIL=0.12 CONFIGS=$c ATTENTION=TRITON_ATTN DEADLINE_S=${DEADLINE_S:-900} \
      CAPTURE=0 RUN_ARGS="--no-attribution --concurrent ${CONCURRENT:-2}" OUT=$JOBS/m-$c \
      WORK=$WORK/m-$c bash scripts/h200_vllm.sh run "$CKPT" > "$JOBS/m-$c.out" 2>&1 &
    if [ "$first" = 1 ]; then  # its first engine start JIT-compiles the Triton kernels for all
      first=0
      for _ in $(seq 90); do grep -q '^== run exit' "$JOBS/m-$c.out" 2>/dev/null && break; sleep 2; done
    fi
  done
  wait
  mkdir -p "$WORK/merged"
  PYTHONPATH=$PYENV python3 -m speccheck.cli merge "$WORK"/m-*/store --store "$WORK/merged/store"
  # every (switch, config) rerun is an engine start of its own (70-130 s on the H200, 2026-12-02):
  # 8 baseline reruns, then up to 8 x 4 spec-side ones; each one's tokens are stored as it ends
  CORPUS=$CORPUS GPU_UTIL=0.1 CONFIGS="$configs" ATTENTION=TRITON_ATTN DEADLINE_S=${ATTR_DEADLINE_S:-900} \
    CAPTURE=0 ATTRIBUTION_MODE=rerun ATTRIBUTION_PATHS=${RERUN_PATHS:-decode*,prefill gdn=*,prefill attention=FLASH_ATTN} \
    RUN_ARGS="--concurrent ${CONCURRENT:-2} --engine-arg attribution_jobs=${ATTRIBUTION_JOBS:-8}" \
    OUT=$JOBS/merged WORK=$WORK/merged bash scripts/h200_vllm.sh run "$CKPT"
}

job_server() {  # once the offline baseline has shown which GDN prefill backend runs here
  until [ -n "$(gdn_used)" ] || [ -f "$JOBS/offline.rc" ]; do sleep 3; done
  local k="--attention-backend TRITON_ATTN"
  [ "$(gdn_used)" = triton ] && k="$k --additional-config {\"gdn_prefill_backend\":\"triton\"}"
  SERVER_KERNELS=$k CKPT=$CKPT CORPUS=$CORPUS OFFLINE_STORE=$WORK/store WORK=/tmp/speccheck-srv \
    OUT=$JOBS/server bash scripts/h200_server.sh sameurl
}

job_flips() {  # once the offline matrix is generated (its attribution running): baselines with
  # one kernel switch flipped each, same corpus and settings otherwise
  until grep -q '^attribution: ' "$JOBS/offline.log" || [ -f "$JOBS/offline.rc" ]; do sleep 3; done
  # the last two: TRITON_ATTN's 2D decode kernel (batch padded past its 3D threshold), alone and
  # with the fused GDN decode kernel: together the target's path under speculation
  local flips=("env.VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0" "enforce_eager=true" "pad_batch=160"
               "env.VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0 --engine-arg pad_batch=160")
  local gdn=""
  if [ "$(gdn_used)" = triton ]; then gdn=triton
  else flips+=('additional_config={"gdn_prefill_backend":"triton"}'); fi
  local i=0 f
  for f in "${flips[@]}"; do
    i=$((i + 1)); echo "== flip $i: $f"
    CORPUS=$CORPUS GPU_UTIL=0.25 CONFIGS='' ATTENTION=TRITON_ATTN GDN_PREFILL=$gdn DEADLINE_S=300 \
      CAPTURE=0 REPEATS=1 RUN_ARGS='--concurrent 0 --no-attribution' OUT=$JOBS/flip$i \
      WORK=/tmp/speccheck-flip$i EXTRA_ARGS="--engine-arg $f" bash scripts/h200_vllm.sh run "$CKPT"
  done
}

job_golden() {  # smoke+code alone under the same defaults: the committed golden/vllm baseline
  until [ -f "$JOBS/export.rc" ]; do sleep 2; done
  CORPUS=smoke+code GPU_UTIL=0.2 CONFIGS='mtp-k3 dflash-k7' ATTENTION=TRITON_ATTN DEADLINE_S=600 \
    CAPTURE=0 RUN_ARGS='--no-attribution' OUT=$JOBS/golden WORK=/tmp/speccheck-golden \
    bash scripts/h200_vllm.sh run "$CKPT"
}

job_bench() {  # the embedded engine's speed on CUDA, once the vLLM jobs beside it are done
  until { [ -f "$JOBS/server.rc" ] || [ ! -f "$JOBS/server.log" ]; } && \
        { [ -f "$JOBS/flips.rc" ] || [ ! -f "$JOBS/flips.log" ]; } && \
        { [ -f "$JOBS/golden.rc" ] || [ ! -f "$JOBS/golden.log" ]; }; do sleep 3; done
  PYTHONPATH=$R python3 benchmarks/bench_reference.py --engine-arg device=cuda ${BENCH_ARGS:---mtp-k 1,3 --dflash-k 7}
}

go() {
  local j
  for j in ${GO_JOBS:-kernels matrix}; do bg "$j" "bash scripts/h200_session.sh job_$j"; done
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
  tar czf "$OUT/session.tgz" --exclude='*.safetensors' --exclude='*.jsonl' -C / "${JOBS#/}" "${WORK#/}" \
    tmp/speccheck-srv $(cd / && ls -d tmp/speccheck-flip* tmp/speccheck-golden 2>/dev/null) 2>/dev/null
  # a file over 16 MiB does not come back from the device: pieces (cat session.tgz.* | tar xz)
  if [ "$(stat -c %s "$OUT/session.tgz")" -gt 15000000 ]; then
    split -b 15000000 "$OUT/session.tgz" "$OUT/session.tgz." && rm "$OUT/session.tgz"
  fi
  ls -la "$OUT"
}

restart() {  # end every job of an earlier `go` (and its servers and workers), keep the staging
  local p
  for p in 'h200_session.sh job_' 'h200_server.sh' 'h200_vllm.sh run' 'vllm.entrypoints' 'vllm_worker' \
           'speccheck.cli'; do pkill -f "$p"; done
  sleep 3
  rm -rf "$WORK/store" "$WORK/gdn_prefill_used" /tmp/speccheck-srv /tmp/speccheck-flip* \
    /tmp/speccheck-golden "$JOBS"
  mkdir -p "$JOBS"
}

case "${1:-}" in
  restart) restart ;;
  prep) prep ;;
  go) go ;;
  job_*) "$1" ;;
  wait) shift; wait_jobs "$@" ;;
  *) sed -n 2,19p "$0"; exit 2 ;;
esac
