#!/usr/bin/env bash
# h200_server.sh — speccheck against vLLM's own OpenAI server on the GPU box (vLLM 0.26.0
# staged into $SITE by scripts/h200_vllm.sh unpack), from the repo root:
#
#   bash scripts/h200_server.sh start     export the reference checkpoint (unless there) and
#       start two servers in their own sessions (they outlive the call while the machine is
#       held): the baseline on :8000 and MTP K=3 on :8001, the same settings as the offline
#       engine (TRITON_ATTN, Triton GDN prefill, eager, no prefix caching, 4 GB KV).
#   bash scripts/h200_server.sh healthy N  N x (`speccheck run --engine openai` of the
#       baseline + `speccheck gate`) into fresh stores: a healthy server must pass N of N.
#   bash scripts/h200_server.sh spec       mtp-k3 through :8001 (rescored on :8000), and the
#       same config offline (`--engine vllm`): teacher-forced agreement side by side.
#   bash scripts/h200_server.sh sameurl    as README's server recipe: the baseline server on
#       :8000, then the same port restarted with MTP K=3, then the baseline again (which
#       rescores the MTP outputs), all into ONE store (one suite), then teacher-forced
#       agreement side by side with the offline store $OFFLINE_STORE (h200_vllm.sh run).
#
# SERVER_KERNELS (default: the old eager + Triton GDN settings) replaces the kernel flags, e.g.
# SERVER_KERNELS="--attention-backend TRITON_ATTN" for CUDA graphs and vLLM's own GDN prefill.
# CORPUS may be a file (e.g. the merged corpus scripts/h200_vllm.sh run wrote).
#
# Everything lands under $OUT (logs, summary.txt, srv.tgz with the stores).
set -uo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
SITE=${SITE:-/root/site}
OUT=${OUT:-/tmp/h200-out}
WORK=${WORK:-/tmp/speccheck-srv}
CKPT=${CKPT:-/tmp/speccheck-ckpt}
CORPUS=${CORPUS:-smoke+code}
LEGACY_SERVER_KERNELS='--attention-backend TRITON_ATTN --additional-config {"gdn_prefill_backend":"triton"} --enforce-eager'
SERVER_KERNELS=${SERVER_KERNELS:-$LEGACY_SERVER_KERNELS}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$R:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:/tmp/speccheck-h200/pydeps${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT" "$WORK"
cd "$R" || exit 2
sc() { python3 -m speccheck.cli "$@"; }
target() { if [ -f "$CKPT/target/config.json" ]; then echo "$CKPT/target"; else echo "$CKPT"; fi; }

corpus_file() {  # smoke+code -> one JSONL of several built-ins (scripts/h200_vllm.sh's merge)
  if [[ "$CORPUS" == *+* ]]; then
    bash "$R/scripts/h200_vllm.sh" merge "$CORPUS" "$WORK"
  else echo "$CORPUS"; fi
}

serve() {  # serve PORT LOG [extra args...]
  local port=$1 log=$2; shift 2
  setsid nohup python3 -m vllm.entrypoints.openai.api_server --model "$(target)" \
    --served-model-name speccheck-ckpt --host 127.0.0.1 --port "$port" --dtype bfloat16 \
    $SERVER_KERNELS --no-enable-prefix-caching --kv-cache-memory-bytes 4000000000 \
    --language-model-only --gpu-memory-utilization 0.2 --max-logprobs 20 "$@" > "$log" 2>&1 < /dev/null &
  echo $! > "$WORK/server-$port.pid"
}

stop() {  # stop PORT: the server started on it, and wait until the port is free
  local pid; pid=$(cat "$WORK/server-$1.pid" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null; for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -9 "$pid" 2>/dev/null; rm -f "$WORK/server-$1.pid"
  for _ in $(seq 1 30); do curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null || return 0; sleep 1; done
}

wait_up() {  # wait_up PORT SECONDS
  local t=0
  until curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null; do
    sleep 3; t=$((t + 3)); [ "$t" -lt "$2" ] || { echo "server :$1 not up after $2 s"; return 1; }
  done
  echo "server :$1 up after ${t}s"
}

start() {
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" || exit 3
  [ -f "$(target)/config.json" ] || sc export-reference "$CKPT" || exit 2
  serve 8000 "$WORK/server-baseline.log"
  serve 8001 "$WORK/server-mtp3.log" \
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'
  wait_up 8000 420 && wait_up 8001 240
  local rc=$?
  tail -5 "$WORK"/server-*.log
  return $rc
}

healthy() {
  local n=${1:-5} corpus pass=0 i
  corpus=$(corpus_file)
  for i in $(seq 1 "$n"); do
    local st="$WORK/healthy$i"; rm -rf "$st"
    echo "== healthy run $i (t=${SECONDS}s)"
    sc run --engine openai --base-url http://127.0.0.1:8000 --method baseline \
      --corpus "$corpus" --store "$st" --engine-arg "tokenizer=$(target)/tokenizer.json" 2>&1 | tail -4
    sc diff --store "$st" 2>&1 | sed -n '1,40p'
    if sc gate --store "$st" > "$WORK/gate$i.txt" 2>&1; then pass=$((pass + 1)); fi
    tail -2 "$WORK/gate$i.txt"
  done
  echo "== healthy server: $pass of $n runs pass the gate"
}

spec() {
  local corpus; corpus=$(corpus_file)
  echo "== mtp-k3 through the server (t=${SECONDS}s)"
  sc run --engine openai --base-url http://127.0.0.1:8001 --config mtp-k3 --corpus "$corpus" \
    --store "$WORK/server_mtp3" --engine-arg "tokenizer=$(target)/tokenizer.json" \
    --engine-arg score_base_url=http://127.0.0.1:8000 2>&1 | tail -4
  sc diff --store "$WORK/server_mtp3" 2>&1 | sed -n '1,60p'
  sc gate --store "$WORK/server_mtp3" 2>&1 | tail -3
  echo "== mtp-k3 offline (t=${SECONDS}s)"
  sc run --engine vllm --model "$(target)" --draft "$CKPT/drafter" --config mtp-k3 \
    --corpus "$corpus" --store "$WORK/offline_mtp3" \
    --engine-arg attention_backend=TRITON_ATTN \
    --engine-arg 'additional_config={"gdn_prefill_backend": "triton"}' \
    --engine-arg env.VLLM_USE_FLASHINFER_SAMPLER=0 --engine-arg language_model_only=true \
    --engine-arg enforce_eager=true --engine-arg enable_prefix_caching=false \
    --engine-arg kv_cache_memory_bytes=4000000000 --engine-arg gpu_memory_utilization=0.2 \
    --engine-arg dtype=bfloat16 2>&1 | tail -4
  sc diff --store "$WORK/offline_mtp3" 2>&1 | sed -n '1,60p'
  sc gate --store "$WORK/offline_mtp3" 2>&1 | tail -3
  for s in server_mtp3 offline_mtp3; do agreement "$WORK/$s" "$s"; done
}

agreement() {  # agreement STORE LABEL: mtp-k3's teacher-forced and prefix agreement there
  sc diff --store "$1" --config mtp-k3 --json 2>/dev/null | python3 -c "
import json, sys; d = json.load(sys.stdin); c = next(c for c in d['configs'] if c['config'] == 'mtp-k3')
print('$2', 'teacher-forced', c['token_agreement'], 'prefix', c['prefix_agreement'], 'classes', c['class_counts'])"
}

sameurl() {
  local corpus st="$WORK/sameurl" tok
  corpus=$(corpus_file); tok="tokenizer=$(target)/tokenizer.json"
  echo "== $(date -u +%FT%TZ) same-URL server runs; kernels: $SERVER_KERNELS"
  stop 8000
  serve 8000 "$WORK/server-sameurl-baseline.log"
  wait_up 8000 600 || { tail -30 "$WORK/server-sameurl-baseline.log"; return 3; }
  sc run --engine openai --base-url http://127.0.0.1:8000 --method baseline --corpus "$corpus" \
    --store "$st" --engine-arg "$tok" --no-attribution 2>&1 | tail -3
  stop 8000
  serve 8000 "$WORK/server-sameurl-mtp3.log" \
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'
  wait_up 8000 600 || { tail -30 "$WORK/server-sameurl-mtp3.log"; return 3; }
  sc run --engine openai --base-url http://127.0.0.1:8000 --method mtp --k 3 --corpus "$corpus" \
    --store "$st" --engine-arg "$tok" --no-attribution 2>&1 | tail -3
  stop 8000  # the baseline server again: it rescores the MTP outputs (never a speculating one)
  serve 8000 "$WORK/server-sameurl-baseline2.log"
  wait_up 8000 600 || { tail -30 "$WORK/server-sameurl-baseline2.log"; return 3; }
  sc run --engine openai --base-url http://127.0.0.1:8000 --method baseline --corpus "$corpus" \
    --store "$st" --engine-arg "$tok" --no-attribution 2>&1 | tail -3
  stop 8000
  sc diff --store "$st" 2>&1 | sed -n '1,80p'
  sc gate --store "$st" 2>&1 | tail -3
  agreement "$st" server
  [ -n "${OFFLINE_STORE:-}" ] && agreement "$OFFLINE_STORE" offline
}

case "${1:-}" in
  start|healthy|spec|sameurl) cmd=$1; shift; { $cmd "$@"; } 2>&1 | tee -a "$OUT/server.log" ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
tar czf "$OUT/srv.tgz" --exclude="*.jsonl" -C "$WORK" . 2>/dev/null
