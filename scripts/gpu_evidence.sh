#!/usr/bin/env bash
# gpu_evidence.sh — speccheck's whole vLLM evidence on one CUDA machine with vLLM importable
# (installed, or a site tree from scripts/bundle_vllm.sh on SITE), from the repo root:
#
#   bash scripts/gpu_evidence.sh [STEP...]      (default: every step, in this order)
#
#   env       versions: Python, torch, vLLM, GPU, driver (versions.txt)
#   export    the reference checkpoint for vLLM (target + MTP, DFlash and DFlash2 drafts) in CKPT
#   run       `speccheck run --engine vllm`: baseline + CONFIGS (DFlash2 configs only where the
#             vLLM version table says this vLLM has DFlash2), REPEATS repeats, CUDA graphs on,
#             kernel attribution of every divergence under this vLLM's switches
#   gate      diff, gate (JUnit), report, golden check (GOLDEN dir; GOLDEN_RECORD=1 records one)
#   proof     each DFlash2 config's proof read back from the engine (dflash2_proof.json):
#             drafter and draft-model classes, V2 model runner, block = K + 1, selector on
#   sampled   the distribution checks at temperature > 0: baseline + SAMPLED_CONFIGS sampled
#             (SAMPLED_T, SAMPLED_TOP_P, SAMPLED_N samples per prompt as one request of n each,
#             SAMPLED_SEED), scored by prompt_logprobs top SCORE_TOP_K, gated (store-sampled)
#   server    vLLM's own OpenAI server: baseline + SERVER_CONFIGS through `--engine openai`
#             (rescored on the baseline server), gated (store-server)
#   bench     measurement overhead: speccheck's warm tok/s beside `vllm bench serve` on the
#             same prompts and server, and each config's gated wall time over its generation
#             time (overhead.json)
#   upgrade   `speccheck upgrade OLD_STORE store` when OLD_STORE names another version's store
#   tp        (not in the default steps; needs TP GPUs) baseline + TP_CONFIGS at tensor_parallel_size
#             1 and TP into store-tp1 and store-tpTP, `doctor --tp`, gate each, then `speccheck
#             compare` of the two (every difference classified; attributed to "TP size" where
#             each size's own rescoring reproduces its token)
#
# Environment (all optional): PY (python, default python3), SITE (a vLLM site tree put first on
# PYTHONPATH), CKPT (default $RESULTS/ckpt), RESULTS (default ./gpu-evidence), CORPUS (default
# smoke), CONFIGS (default "mtp-k1 mtp-k3 mtp-k7 dflash-k7 dflash2-k1 dflash2-k3 dflash2-k7"),
# SERVER_CONFIGS (default "mtp-k3 dflash2-k7"), REPEATS (2), AXES (`speccheck run --axes`:
# default = every axis the engine runs; none = the corpus alone), ATTENTION (TRITON_ATTN; auto = vLLM's
# choice), GDN_PREFILL (triton; empty = vLLM's default), EXTRA_ARGS (more --engine-arg pairs),
# GPU_UTIL (0.25), PORT (8000: servers use PORT..PORT+n), DEADLINE_S (no new step after it,
# default 3000), OLD_STORE, GOLDEN (default golden), GOLDEN_RECORD (0), TP (2), TP_CONFIGS
# (default "mtp-k3 dflash-k7"), SAMPLED_CONFIGS (default "mtp-k3 dflash2-k7"), SAMPLED_CORPUS
# (default), SAMPLED_T (0.7), SAMPLED_TOP_P (0.9), SAMPLED_N (8), SAMPLED_SEED (0), SCORE_TOP_K (100).
# Exit: 0 when every step that ran passed, else the first failing step's code. A step's log is
# RESULTS/<step>.log; summary.txt collects the verdicts.
set -uo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
RESULTS=$(mkdir -p "${RESULTS:-$PWD/gpu-evidence}" && cd "${RESULTS:-$PWD/gpu-evidence}" && pwd)
CKPT=${CKPT:-$RESULTS/ckpt}
CORPUS=${CORPUS:-smoke}
CONFIGS=${CONFIGS:-mtp-k1 mtp-k3 mtp-k7 dflash-k7 dflash2-k1 dflash2-k3 dflash2-k7}
SERVER_CONFIGS=${SERVER_CONFIGS:-mtp-k3 dflash2-k7}
REPEATS=${REPEATS:-2}
AXES=${AXES:-default}
ATTENTION=${ATTENTION:-TRITON_ATTN}
GDN_PREFILL=${GDN_PREFILL-triton}
GPU_UTIL=${GPU_UTIL:-0.25}
PORT=${PORT:-8000}
DEADLINE_S=${DEADLINE_S:-3000}
GOLDEN=${GOLDEN:-golden}
STORE=$RESULTS/store
SSTORE=$RESULTS/store-server
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export PYTHONPATH="$R${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export SPECCHECK_VLLM_LOG_DIR=$RESULTS/worker-logs
cd "$R" || exit 2
sc() { "$PY" -m speccheck.cli "$@"; }
note() { echo "$*" | tee -a "$RESULTS/summary.txt"; }
target() { if [ -f "$CKPT/target/config.json" ]; then echo "$CKPT/target"; else echo "$CKPT"; fi; }
vllm_version() { "$PY" -c "import vllm; print(vllm.__version__)" 2>/dev/null; }
has_dflash2() {
  "$PY" -c "import sys; from speccheck.engines.vllm_versions import release_entry as r; \
sys.exit(0 if r(sys.argv[1]).dflash2 else 1)" "$(vllm_version)"
}
configs() {  # CONFIGS without DFlash2 where this vLLM has none (the version table says)
  local c out=()
  for c in $1; do
    if [[ $c == dflash2-* ]] && ! has_dflash2; then
      note "skip $c: vLLM $(vllm_version) has no DFlash2 (speccheck/engines/vllm_versions.py)"; continue
    fi
    out+=("$c")
  done
  echo "${out[@]}"
}
engine_args() {
  local a=(--engine-arg dtype=bfloat16 --engine-arg language_model_only=true
           --engine-arg enable_prefix_caching=false --engine-arg kv_cache_memory_bytes=4000000000
           --engine-arg "gpu_memory_utilization=$GPU_UTIL" --engine-arg worker=per-config
           --engine-arg "env.VLLM_USE_FLASHINFER_SAMPLER=$VLLM_USE_FLASHINFER_SAMPLER")
  [ "$ATTENTION" != auto ] && a+=(--engine-arg "attention_backend=$ATTENTION")
  [ -n "$GDN_PREFILL" ] && a+=(--engine-arg "additional_config={\"gdn_prefill_backend\": \"$GDN_PREFILL\"}")
  [ -d "$CKPT/dflash2" ] && a+=(--engine-arg "dflash2_draft=$CKPT/dflash2")
  # shellcheck disable=SC2206
  [ -n "${EXTRA_ARGS:-}" ] && a+=(${EXTRA_ARGS})
  printf '%s\n' "${a[@]}"
}

step_env() {
  {
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    "$PY" -c "import vllm; print('vllm', vllm.__version__, vllm.__file__)"
  } | tee "$RESULTS/versions.txt"
  vllm_version > /dev/null || { note "env: vLLM is not importable"; return 3; }
}

step_export() {
  [ -f "$(target)/config.json" ] && { echo "checkpoint there: $CKPT"; return 0; }
  sc export-reference "$CKPT"
}

step_run() {
  local cfgs=() c ea
  mapfile -t ea < <(engine_args)
  for c in $(configs "$CONFIGS"); do cfgs+=(--config "$c"); done
  sc run --engine vllm --model "$(target)" --draft "$CKPT/drafter" --corpus "$CORPUS" \
    --repeats "$REPEATS" --axes "$AXES" --store "$STORE" "${ea[@]}" "${cfgs[@]}"
}

step_gate() {
  sc diff --store "$STORE" > "$RESULTS/diff.txt" 2>&1
  sc report --store "$STORE" --out "$RESULTS/report" > /dev/null 2>&1
  sc gate --store "$STORE" --junit "$RESULTS/junit.xml" > "$RESULTS/gate.txt" 2>&1
  local rc=$?
  tail -20 "$RESULTS/gate.txt"; note "gate: exit $rc"
  if [ "${GOLDEN_RECORD:-0}" = 1 ]; then
    sc golden record --store "$STORE" --golden "$GOLDEN"; note "golden record: exit $?"
  else
    sc golden check --store "$STORE" --golden "$GOLDEN"; note "golden check: exit $? ($GOLDEN)"
  fi
  return $rc
}

step_proof() {
  "$PY" - "$STORE" "$RESULTS/dflash2_proof.json" <<'PYEOF'
import json, sys
from speccheck.api import open_suite
s = open_suite(sys.argv[1])
out = {}
for name in s.configs():
    if name.startswith("dflash2-") and s.is_complete(name, 0):
        ident = s.run_identity(name, 0)
        out[name] = {k: ident.get(k) for k in ("vllm_version", "dflash2", "draft_class", "draft_block", "drafter")}
json.dump(out, open(sys.argv[2], "w"), indent=1, default=str)
for name, p in out.items():
    d2 = p["dflash2"] or {}
    print(name, "selector", d2.get("selector"), "runner", d2.get("model_runner"), "draft", p["draft_class"],
          "block", p["draft_block"])
sys.exit(0 if out and all((p["dflash2"] or {}).get("selector") == "on" for p in out.values()) else 1)
PYEOF
  local rc=$?; note "dflash2 proof: exit $rc"; return $rc
}

serve() {  # serve PORT LOG [vllm serve args...]: a server in its own session, pid in RESULTS
  local port=$1 log=$2; shift 2
  local attn=(); [ "$ATTENTION" != auto ] && attn=(--attention-backend "$ATTENTION")
  local gdn=(); [ -n "$GDN_PREFILL" ] && gdn=(--additional-config "{\"gdn_prefill_backend\": \"$GDN_PREFILL\"}")
  setsid nohup "$PY" -m vllm.entrypoints.openai.api_server --model "$(target)" \
    --served-model-name speccheck-ckpt --host 127.0.0.1 --port "$port" --dtype bfloat16 "${attn[@]}" \
    "${gdn[@]}" --no-enable-prefix-caching --kv-cache-memory-bytes 4000000000 --language-model-only \
    --gpu-memory-utilization "$GPU_UTIL" --max-logprobs 20 "$@" > "$log" 2>&1 < /dev/null &
  echo $! > "$RESULTS/server-$port.pid"
}
stop_servers() {
  local f; for f in "$RESULTS"/server-*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; rm -f "$f"; done
}
wait_up() {  # wait_up PORT SECONDS
  local t=0
  until curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null; do
    sleep 3; t=$((t + 3)); [ "$t" -lt "$2" ] || { echo "server :$1 not up after $2 s"; return 1; }
  done
}
spec_json() {  # spec_json CONFIG: vLLM's --speculative-config of a speccheck config name
  local m=${1%-k*} k=${1##*-k}
  case $m in
    mtp) echo "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}" ;;
    dflash) echo "{\"method\": \"dflash\", \"model\": \"$CKPT/drafter\", \"num_speculative_tokens\": $k}" ;;
    dflash2) echo "{\"method\": \"dflash\", \"model\": \"$CKPT/dflash2\", \"num_speculative_tokens\": $k}" ;;
  esac
}

step_server() {
  local i=1 c rc=0 tok="tokenizer=$(target)/tokenizer.json" base="http://127.0.0.1:$PORT"
  serve "$PORT" "$RESULTS/server-baseline.log"
  for c in $(configs "$SERVER_CONFIGS"); do
    VLLM_USE_V2_MODEL_RUNNER=$([[ $c == dflash2-* ]] && echo 1 || echo "${VLLM_USE_V2_MODEL_RUNNER:-}") \
      serve $((PORT + i)) "$RESULTS/server-$c.log" --speculative-config "$(spec_json "$c")"
    i=$((i + 1))
  done
  wait_up "$PORT" 600 || { tail -30 "$RESULTS/server-baseline.log"; stop_servers; return 3; }
  sc run --engine openai --base-url "$base" --method baseline --corpus "$CORPUS" --store "$SSTORE" \
    --engine-arg "$tok" || rc=$?
  i=1
  for c in $(configs "$SERVER_CONFIGS"); do
    if wait_up $((PORT + i)) 600; then
      sc run --engine openai --base-url "http://127.0.0.1:$((PORT + i))" --config "$c" --corpus "$CORPUS" \
        --store "$SSTORE" --engine-arg "$tok" --engine-arg "score_base_url=$base" || rc=$?
    else
      tail -30 "$RESULTS/server-$c.log"; rc=3
    fi
    i=$((i + 1))
  done
  sc gate --store "$SSTORE" > "$RESULTS/gate-server.txt" 2>&1; local g=$?
  tail -12 "$RESULTS/gate-server.txt"; note "server gate: exit $g"
  [ "${KEEP_SERVERS:-0}" = 1 ] || stop_servers
  [ $rc = 0 ] && return $g || return $rc
}

step_bench() {
  "$PY" - "$STORE" "$SSTORE" "$RESULTS/overhead.json" <<'PYEOF'
import json, sys
from speccheck.api import open_suite
from speccheck.evaluate import speed_of
out = {"offline": {}, "server": {}}
for key, path in (("offline", sys.argv[1]), ("server", sys.argv[2])):
    try:
        s = open_suite(path)
    except Exception as e:  # noqa: BLE001 - that step did not run
        out[key] = {"error": str(e)}
        continue
    for name in s.configs():
        recs = [r for r in s.records(name) if r.status == "ok"]
        if not recs:
            continue
        gen = sum(c.ttft_s + c.decode_s for c in recs[0].completions)
        out[key][name] = {"warm_tok_s": speed_of(recs)[0], "run_wall_s": recs[0].wall_s,
                          "generation_s": gen, "wall_over_generation": recs[0].wall_s / gen if gen else None}
json.dump(out, open(sys.argv[3], "w"), indent=1)
print(json.dumps(out, indent=1))
PYEOF
  note "overhead: $RESULTS/overhead.json"
  # vLLM's own benchmark, single stream, on the corpus' prompts, against a server of each config
  "$PY" - "$CORPUS" "$RESULTS/bench-prompts.jsonl" <<'PYEOF'
import json, sys
from speccheck.corpus import load_corpus
with open(sys.argv[2], "w") as f:
    for p in load_corpus(sys.argv[1]).prompts:
        f.write(json.dumps({"prompt": p.as_text()}) + "\n")
PYEOF
  local c n len
  n=$(wc -l < "$RESULTS/bench-prompts.jsonl")
  len=$("$PY" -c "import statistics, sys; from speccheck.corpus import load_corpus; \
print(int(statistics.median(p.max_tokens for p in load_corpus(sys.argv[1]).prompts)))" "$CORPUS")
  for c in baseline $(configs "$SERVER_CONFIGS"); do
    if [ "$c" = baseline ]; then serve "$PORT" "$RESULTS/server-bench-$c.log"
    else VLLM_USE_V2_MODEL_RUNNER=$([[ $c == dflash2-* ]] && echo 1 || echo "${VLLM_USE_V2_MODEL_RUNNER:-}") \
      serve "$PORT" "$RESULTS/server-bench-$c.log" --speculative-config "$(spec_json "$c")"; fi
    if wait_up "$PORT" 600; then
      "$PY" -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url "http://127.0.0.1:$PORT" \
        --model speccheck-ckpt --tokenizer "$(target)" --dataset-name custom \
        --dataset-path "$RESULTS/bench-prompts.jsonl" --custom-output-len "$len" --num-prompts "$n" \
        --max-concurrency 1 --save-result --result-dir "$RESULTS/bench" --result-filename "$c.json" \
        2>&1 | tail -20
      note "vllm bench serve $c: exit ${PIPESTATUS[0]} ($RESULTS/bench/$c.json; compare 1/TPOT with overhead.json)"
    fi
    stop_servers; sleep 2
  done
}

step_upgrade() {
  [ -n "${OLD_STORE:-}" ] || { echo "OLD_STORE not set: no upgrade to judge"; return 0; }
  sc upgrade "$OLD_STORE" "$STORE" > "$RESULTS/upgrade.txt" 2>&1; local rc=$?
  cat "$RESULTS/upgrade.txt"; note "upgrade $OLD_STORE -> $STORE: exit $rc"; return $rc
}

step_tp() {
  local tp=${TP:-2} cfgs=() c ea rc=0 size
  mapfile -t ea < <(engine_args)
  for c in $(configs "${TP_CONFIGS:-mtp-k3 dflash-k7}"); do cfgs+=(--config "$c"); done
  sc doctor --engine vllm --model "$(target)" --tp "$tp" || rc=$?
  nvidia-smi topo -m 2>&1 | tee "$RESULTS/topo.txt"
  for size in 1 "$tp"; do
    sc run --engine vllm --model "$(target)" --draft "$CKPT/drafter" --corpus "$CORPUS" \
      --repeats "$REPEATS" --axes none --store "$RESULTS/store-tp$size" "${ea[@]}" "${cfgs[@]}" \
      --engine-arg "tensor_parallel_size=$size" || rc=$?
    sc gate --store "$RESULTS/store-tp$size" > "$RESULTS/gate-tp$size.txt" 2>&1; note "gate TP=$size: exit $?"
  done
  sc compare --store "$RESULTS/store-tp1" --with-store "$RESULTS/store-tp$tp" > "$RESULTS/compare-tp.txt" 2>&1
  local crc=$?; tail -5 "$RESULTS/compare-tp.txt"; note "compare TP=1 vs TP=$tp: exit $crc"
  [ "$rc" = 0 ] && rc=$crc; return $rc
}

step_sampled() {  # the distribution checks at temperature > 0 (SAMPLED_* below), gated
  local cfgs=() c ea rc
  mapfile -t ea < <(engine_args)
  for c in $(configs "${SAMPLED_CONFIGS:-mtp-k3 dflash2-k7}"); do cfgs+=(--config "$c"); done
  sc run --engine vllm --model "$(target)" --draft "$CKPT/drafter" --corpus "${SAMPLED_CORPUS:-default}" \
    --temperature "${SAMPLED_T:-0.7}" --top-p "${SAMPLED_TOP_P:-0.9}" --samples "${SAMPLED_N:-8}" \
    --seed "${SAMPLED_SEED:-0}" --engine-arg "score_top_k=${SCORE_TOP_K:-100}" \
    --store "$RESULTS/store-sampled" "${ea[@]}" "${cfgs[@]}" || return $?
  sc diff --store "$RESULTS/store-sampled" > "$RESULTS/diff-sampled.txt" 2>&1
  sc report --store "$RESULTS/store-sampled" --out "$RESULTS/report-sampled" > /dev/null 2>&1
  sc gate --store "$RESULTS/store-sampled" --junit "$RESULTS/junit-sampled.xml" > "$RESULTS/gate-sampled.txt" 2>&1
  rc=$?
  grep -E "distribution|two-sample" "$RESULTS/diff-sampled.txt"; tail -5 "$RESULTS/gate-sampled.txt"
  note "gate sampled (T ${SAMPLED_T:-0.7}, top-p ${SAMPLED_TOP_P:-0.9}): exit $rc"; return $rc
}

STEPS=("$@"); [ ${#STEPS[@]} -gt 0 ] || STEPS=(env export run gate proof sampled server bench upgrade)
first=0
trap stop_servers EXIT
for s in "${STEPS[@]}"; do
  if [ "$SECONDS" -gt "$DEADLINE_S" ]; then note "$s: not started (past DEADLINE_S=$DEADLINE_S)"; continue; fi
  echo "== $s (t=${SECONDS}s)"
  "step_$s" 2>&1 | tee "$RESULTS/$s.log"
  rc=${PIPESTATUS[0]}
  note "step $s: exit $rc (t=${SECONDS}s)"
  [ "$rc" != 0 ] && [ "$first" = 0 ] && first=$rc
done
exit "$first"
