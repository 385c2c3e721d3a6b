#!/usr/bin/env bash
# h200_vllm.sh — speccheck's vLLM run on the GPU box (vLLM 0.26.0 staged by
# ../shared/tools/stage-vllm.sh into $SITE), from the repo root:
#
#   bash scripts/h200_vllm.sh run [CKPT_DIR]
#       exports the reference checkpoint to CKPT_DIR (default /tmp/speccheck-ckpt) unless it
#       is there (env PAD_HEAD_DIM=128: GDN heads padded to 128, the same network, as
#       FlashInfer's SM90 GDN prefill kernel needs; default dir /tmp/speccheck-ckpt-pad128),
#       then `speccheck run --engine vllm`: baseline, MTP K=1,3,7 and DFlash K=7
#       (env CONFIGS), 2 repeats and the corpus all at once (each prompt twice), with CUDA
#       graphs and vLLM's default GDN prefill backend (env LEGACY_KERNELS=1: enforce_eager +
#       Triton GDN prefill as before; GDN_PREFILL, ATTENTION: one switch each; CORPUS may be
#       a path, e.g. Spec-Bench's question.jsonl, MAX_TOKENS its max_tokens); then
#       attribution re-scores every divergence under vLLM's kernel variants; then diff, gate
#       and report; then
#       (time permitting, CAPTURE=1) scripts/capture_vllm_fixtures.py for fixtures the run did
#       not capture. REPEATS, RUN_ARGS (more `speccheck run` options), EXTRA_ARGS (more
#       --engine-arg options: one kernel switch flipped), ATTRIBUTION_PATHS, ATTRIBUTION_MODE
#       (rescore|rerun), GPU_UTIL. Everything comes back under $OUT: run.log, summary.txt, h200.tgz (store,
#       fixtures, worker logs, report). Stops launching work after DEADLINE_S (default 500).
#
#   TP=2 bash scripts/h200_vllm.sh tp [CKPT_DIR]
#       tensor parallel on a host with >= TP GPUs (a 2-GPU kind: nvidia-h200-x2): `speccheck
#       doctor --tp $TP`, `nvidia-smi topo -m`, then baseline + mtp-k3 + dflash-k7 (env
#       TP_CONFIGS) on smoke+code at tensor_parallel_size=1 into $WORK/store-tp1 and at
#       tensor_parallel_size=$TP into $WORK/store-tp$TP (2 repeats each: determinism x2 at
#       each size; kernel attribution off unless ATTRIBUTION=1, then ATTRIBUTION_PATHS
#       picks the paths), `speccheck gate` on each
#       store, then `speccheck compare` of the TP=1 suite with the TP=$TP suite (every
#       difference classified; attributed to "TP size" where each size's stored rescoring
#       reproduces its own token). Stops launching work after DEADLINE_S; the same command
#       again resumes (stored runs are skipped). Under $OUT: tp.log, tp-summary.txt, tp.tgz.
#
#   bash scripts/h200_vllm.sh pack
#       here, before the device calls: if the working tree plus one staged part would not fit
#       in one 64 MiB transfer, split .stage/{A,B,C} (and D, FlashInfer, when
#       scripts/stage_flashinfer.sh made it) into pieces under .stage/pieces/NN that
#       do, and print the device calls; otherwise print that the plain A/B/C steps fit.
#   bash scripts/h200_vllm.sh unpack DIR
#       on the GPU box: keep the pieces carried in DIR under $PIECES and unpack every
#       part whose pieces are all there into $SITE.
set -uo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
SITE=${SITE:-/root/site}
OUT=${OUT:-/tmp/h200-out}
DEADLINE_S=${DEADLINE_S:-510}
CORPUS=${CORPUS:-smoke+code}
CONFIGS=${CONFIGS:-mtp-k7 dflash-k7 mtp-k3 mtp-k1}
WORK=${WORK:-/tmp/speccheck-h200}
PIECES=${PIECES:-/root/pieces}
ATTENTION=${ATTENTION:-TRITON_ATTN}   # the staged tree's target ran with it; auto = vLLM's choice
GDN_PREFILL=${GDN_PREFILL:-}         # empty: vLLM's default (FlashInfer on SM90)
LEGACY_KERNELS=${LEGACY_KERNELS:-0}  # 1: enforce_eager + Triton GDN prefill, as before
PAD_HEAD_DIM=${PAD_HEAD_DIM:-}       # e.g. 128: export-reference --linear-head-dim (FlashInfer needs 128)

sc() { python3 -m speccheck.cli "$@"; }

merge_corpora() {  # merge_corpora A+B+PATH DIR: one JSONL of built-ins and corpus files (Spec-Bench's
  # question.jsonl is read through speccheck's importer, first turn, max_tokens ${MAX_TOKENS:-128})
  python3 - "$1" "$2" "${MAX_TOKENS:-128}" <<'PY'
import json, re, sys
from speccheck.corpus import load_corpus
names, out_dir, max_tokens = sys.argv[1].split("+"), sys.argv[2], int(sys.argv[3])
path = f"{out_dir}/{re.sub(r'[^A-Za-z0-9]+', '_', '+'.join(n.split('/')[-1] for n in names))}.jsonl"
with open(path, "w") as out:
    for name in names:
        for p in load_corpus(name, max_tokens=max_tokens).prompts:
            rec = {"id": p.id, "category": p.category, "max_tokens": p.max_tokens}
            rec.update({"messages": [dict(m) for m in p.messages]} if p.messages else {"text": p.text})
            if getattr(p, "ignore_eos", False):
                rec["ignore_eos"] = True
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
print(path)
PY
}
left() { echo $((DEADLINE_S - SECONDS)); }

run() {
  local ckpt=${1:-/tmp/speccheck-ckpt${PAD_HEAD_DIM:+-pad$PAD_HEAD_DIM}}
  mkdir -p "$OUT" "$WORK"
  cd "$R" || exit 2
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
  export PYTHONPATH="$R:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$WORK/pydeps${PYTHONPATH:+:$PYTHONPATH}"
  export SPECCHECK_VLLM_CAPTURE_DIR="$WORK/fixtures" SPECCHECK_VLLM_LOG_DIR="$WORK/logs"
  local store="$WORK/store"
  {
    echo "== $(date -u +%FT%TZ) host: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
    # packages the image lacks (rapidfuzz), carried as wheels in .stage/whl
    if ls .stage/whl/*.whl >/dev/null 2>&1 && [ ! -d "$WORK/pydeps" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/pydeps" .stage/whl/*.whl
    fi
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    if [ ! -f "$ckpt/config.json" ] && [ ! -f "$ckpt/target/config.json" ]; then
      echo "== export-reference $ckpt ${PAD_HEAD_DIM:+(GDN heads padded to $PAD_HEAD_DIM)}"
      sc export-reference "$ckpt" ${PAD_HEAD_DIM:+--linear-head-dim "$PAD_HEAD_DIM"} || exit 2
    fi
    if [[ "$CORPUS" == *+* ]]; then  # e.g. smoke+code+PATH: one corpus file of several
      CORPUS=$(merge_corpora "$CORPUS" "$WORK") || exit 2
    fi
    local target=$ckpt draft=$ckpt/drafter
    [ -f "$ckpt/target/config.json" ] && target=$ckpt/target
    echo "== target $target  drafter $draft  ($(du -sh "$ckpt" | cut -f1))"
    # what `vllm serve` runs: CUDA graphs + torch.compile, vLLM's own GDN prefill backend
    # (FlashInfer on SM90: flashinfer must be staged). LEGACY_KERNELS=1 restores the old
    # settings (enforce_eager, Triton/FLA GDN prefill); GDN_PREFILL=triton|flashinfer and
    # ATTENTION=auto|FLASH_ATTN|TRITON_ATTN|FLASHINFER pick one switch each.
    local ea=(--engine-arg env.VLLM_USE_FLASHINFER_SAMPLER=0
              --engine-arg language_model_only=true
              --engine-arg enable_prefix_caching=false
              --engine-arg kv_cache_memory_bytes=4000000000
              --engine-arg worker=per-config)
    [ "$ATTENTION" != auto ] && ea+=(--engine-arg "attention_backend=$ATTENTION")
    if [ "$LEGACY_KERNELS" = 1 ]; then
      ea+=(--engine-arg enforce_eager=true)
      GDN_PREFILL=${GDN_PREFILL:-triton}
    fi
    [ -n "$GDN_PREFILL" ] && ea+=(--engine-arg "additional_config={\"gdn_prefill_backend\": \"$GDN_PREFILL\"}")
    [ -n "${GPU_UTIL:-}" ] && ea+=(--engine-arg "gpu_memory_utilization=$GPU_UTIL")  # room for a server beside
    echo "== kernel settings: attention=$ATTENTION gdn_prefill=${GDN_PREFILL:-vLLM default} legacy=$LEGACY_KERNELS"
    ea+=(--engine-arg dtype=bfloat16)
    [ -n "${EXTRA_ARGS:-}" ] && read -r -a extra <<< "$EXTRA_ARGS" && ea+=("${extra[@]}")  # e.g. one switch flipped
    attempt() {  # attempt ARGS...: one `speccheck run` into the store, within the deadline
      echo "== run $* (t=${SECONDS}s, deadline ${DEADLINE_S}s)"
      [ "$(left)" -gt 20 ] || { echo "== skipped: deadline"; return 124; }
      timeout --kill-after=20 "$(left)" python3 -m speccheck.cli run --engine vllm \
        --model "$target" --draft "$draft" --corpus "$CORPUS" --repeats "${REPEATS:-2}" ${RUN_ARGS:-} \
        ${MAX_TOKENS:+--max-tokens "$MAX_TOKENS"} ${ATTRIBUTION_PATHS:+--attribution-paths "$ATTRIBUTION_PATHS"} \
        ${ATTRIBUTION_MODE:+--attribution-mode "$ATTRIBUTION_MODE"} --store "$store" "${ea[@]}" "$@"
      local rc=$?
      echo "== run exit $rc (t=${SECONDS}s)"
      if [ "$rc" != 0 ]; then
        local log; log=$(ls -t "$WORK"/logs/* 2>/dev/null | head -1)
        [ -n "$log" ] && { echo "-- tail of $log"; tail -40 "$log"; }
      fi
      return $rc
    }
    # the baseline first: if vLLM cannot load the export as configured, try once with its
    # own tokenizer initialised (the multimodal Qwen3.5 class may want one) before the matrix
    if ! attempt --method baseline; then
      if [ -z "$GDN_PREFILL" ] && [ "$LEGACY_KERNELS" != 1 ]; then
        # vLLM 0.26 picks FlashInfer's GDN prefill on SM90 whatever the head dim; its kernel
        # there takes head dim 128 only, and needs part D staged (scripts/stage_flashinfer.sh)
        echo "== vLLM's default GDN prefill failed (log above); falling back to Triton/FLA"
        GDN_PREFILL=triton
        ea+=(--engine-arg 'additional_config={"gdn_prefill_backend": "triton"}')
      else
        ea+=(--engine-arg skip_tokenizer_init=false)
      fi
      attempt --method baseline
    fi
    echo "${GDN_PREFILL:-default}" > "$WORK/gdn_prefill_used"  # for a server started beside it
    local cfgs=()
    for c in $CONFIGS; do cfgs+=(--config "$c"); done
    [ ${#cfgs[@]} -gt 0 ] && attempt "${cfgs[@]}"  # CONFIGS='': the baseline alone
    if [ -d "$store" ]; then
      echo "== diff"; sc diff --store "$store" 2>&1
      echo "== gate"; sc gate --store "$store" --junit "$WORK/junit.xml" 2>&1; echo "gate exit $?"
      sc report --store "$store" --out "$WORK/report" 2>&1
    fi
    local missing=0
    for f in baseline mtp_k3 prompt_logprobs; do [ -f "$WORK/fixtures/$f.json" ] || missing=1; done
    if [ "$missing" = 1 ] && [ "${CAPTURE:-1}" = 1 ] && [ "$(left)" -gt 150 ]; then
      echo "== capture fixtures (t=${SECONDS}s)"
      timeout --kill-after=20 "$(left)" python3 scripts/capture_vllm_fixtures.py \
        --model "$target" --draft "$draft" --out "$WORK/fixtures" "${ea[@]}" 2>&1 | tail -40
    fi
    ls -la "$WORK/fixtures" 2>&1
    echo "== done t=${SECONDS}s"
  } 2>&1 | tee "$OUT/run.log"
  grep -A400 "^== diff" "$OUT/run.log" > "$OUT/summary.txt" 2>/dev/null
  tar czf "$OUT/h200.tgz" -C "$WORK" store fixtures logs report junit.xml 2>/dev/null
  ls -la "$OUT"
}

# ---------------------------------------------------------------- tensor parallel

TP=${TP:-2}
TP_CONFIGS=${TP_CONFIGS:-mtp-k3 dflash-k7}
ATTRIBUTION=${ATTRIBUTION:-0}

tp() {
  local ckpt=${1:-/tmp/speccheck-ckpt}
  mkdir -p "$OUT" "$WORK"
  cd "$R" || exit 2
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
  export PYTHONPATH="$R:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$WORK/pydeps${PYTHONPATH:+:$PYTHONPATH}"
  export SPECCHECK_VLLM_LOG_DIR="$WORK/logs"
  {
    echo "== $(date -u +%FT%TZ) tp mode: TP=1 vs TP=$TP; configs baseline $TP_CONFIGS; corpus $CORPUS"
    nvidia-smi --query-gpu=index,name,driver_version,memory.free --format=csv,noheader 2>&1
    echo "== nvidia-smi topo -m"; nvidia-smi topo -m 2>&1
    if ls .stage/whl/*.whl >/dev/null 2>&1 && [ ! -d "$WORK/pydeps" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/pydeps" .stage/whl/*.whl
    fi
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
    if [ ! -f "$ckpt/config.json" ] && [ ! -f "$ckpt/target/config.json" ]; then
      echo "== export-reference $ckpt"; sc export-reference "$ckpt" || exit 2
    fi
    local target=$ckpt draft=$ckpt/drafter corpus=$CORPUS
    [ -f "$ckpt/target/config.json" ] && target=$ckpt/target
    if [[ "$corpus" == *+* ]]; then
      corpus=$(merge_corpora "$corpus" "$WORK") || exit 2
    fi
    echo "== doctor --tp $TP"; sc doctor --engine vllm --model "$target" --tp "$TP" 2>&1
    local ea=(--engine-arg env.VLLM_USE_FLASHINFER_SAMPLER=0
              --engine-arg language_model_only=true
              --engine-arg enable_prefix_caching=false
              --engine-arg kv_cache_memory_bytes=4000000000
              --engine-arg worker=per-config --engine-arg dtype=bfloat16)
    [ "$ATTENTION" != auto ] && ea+=(--engine-arg "attention_backend=$ATTENTION")
    [ -n "$GDN_PREFILL" ] && ea+=(--engine-arg "additional_config={\"gdn_prefill_backend\": \"$GDN_PREFILL\"}")
    local attr=(--no-attribution)
    [ "$ATTRIBUTION" = 1 ] && attr=(${ATTRIBUTION_PATHS:+--attribution-paths "$ATTRIBUTION_PATHS"})
    local cfgs=(--config baseline)
    for c in $TP_CONFIGS; do cfgs+=(--config "$c"); done
    local size
    for size in 1 "$TP"; do
      local store="$WORK/store-tp$size"
      echo "== TP=$size: run ${cfgs[*]} into $store (t=${SECONDS}s, deadline ${DEADLINE_S}s)"
      if [ "$(left)" -gt 30 ]; then
        timeout --kill-after=20 "$(left)" python3 -m speccheck.cli run --engine vllm \
          --model "$target" --draft "$draft" --corpus "$corpus" --repeats 2 --store "$store" \
          "${ea[@]}" --engine-arg "tensor_parallel_size=$size" "${attr[@]}" "${cfgs[@]}"
        echo "== TP=$size run exit $? (t=${SECONDS}s)"
      else
        echo "== TP=$size skipped: deadline (run the same command again: it resumes)"
      fi
      [ -d "$store" ] && { echo "== gate TP=$size"; sc gate --store "$store" 2>&1; echo "gate TP=$size exit $?"; }
    done
    if [ -d "$WORK/store-tp1" ] && [ -d "$WORK/store-tp$TP" ]; then
      echo "== compare TP=1 vs TP=$TP"
      sc compare --store "$WORK/store-tp1" --with-store "$WORK/store-tp$TP" 2>&1
      echo "compare exit $?"
    fi
    echo "== done t=${SECONDS}s"
  } 2>&1 | tee "$OUT/tp.log"
  grep -A400 "^== gate TP=1" "$OUT/tp.log" > "$OUT/tp-summary.txt" 2>/dev/null
  tar czf "$OUT/tp.tgz" -C "$WORK" "store-tp1" "store-tp$TP" logs 2>/dev/null
  ls -la "$OUT"
}

# ---------------------------------------------------------------- transfer pieces

tree_mib() {  # size of what one device call sends: tracked + untracked-not-ignored files
  (cd "$R" && git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null \
     | awk '{s+=$1} END {printf "%d", s/1048576 + 1}')
}

pack() {
  cd "$R" || exit 2
  local tree budget fits=1
  tree=${TREE_MIB:-$(tree_mib)}; budget=$((61 - tree))
  for p in A B C D; do
    [ -f ".stage/$p/$p.tar.xz" ] || continue  # D (FlashInfer) only after scripts/stage_flashinfer.sh
    local sz=$(( $(stat -c %s ".stage/$p/$p.tar.xz") / 1048576 + 1 ))
    [ "$sz" -gt "$budget" ] && fits=0
    echo "part $p: ${sz} MiB (budget per call with a ${tree} MiB tree: ${budget} MiB)"
  done
  if [ "$fits" = 1 ]; then echo "fits: use the A, B, C steps that stage-vllm.sh prints"; return 0; fi
  rm -rf .stage/pieces; mkdir -p .stage/pieces
  # fill each call up to the budget; the first also carries .stage/whl, the last runs
  python3 - "$budget" <<'PY'
import os, sys
budget = (int(sys.argv[1]) - 1) << 20
parts = {p: open(f".stage/{p}/{p}.tar.xz", "rb").read() for p in "ABCD"
         if os.path.exists(f".stage/{p}/{p}.tar.xz")}
whl = sum(os.path.getsize(f".stage/whl/{f}") for f in os.listdir(".stage/whl")) \
    if os.path.isdir(".stage/whl") else 0
calls, room = [[]], budget - whl
for p, data in parts.items():
    off, chunks = 0, []
    while off < len(data):
        if room <= 1 << 20:
            calls.append([]); room = budget
        n = min(room, len(data) - off)
        chunks.append((len(calls) - 1, data[off:off + n])); off += n; room -= n
    for i, (call, chunk) in enumerate(chunks):
        d = f".stage/pieces/{call:02d}"; os.makedirs(d, exist_ok=True)
        open(f"{d}/{p}.of{len(chunks)}.part{i:02d}", "wb").write(chunk)
for i in range(len(calls)):
    d = f".stage/pieces/{i:02d}"
    size = sum(os.path.getsize(f"{d}/{f}") for f in os.listdir(d)) >> 20
    last = i == len(calls) - 1
    carry = f'["{d}", ".stage/whl"]' if i == 0 else f'["{d}"]'
    cmd = f"bash scripts/h200_vllm.sh unpack {d}" + (" && bash scripts/h200_vllm.sh run" if last else "")
    print(f"device call {i + 1}: carry {carry} ({size} MiB)\n   command: {cmd}")
PY
}

unpack() {
  local dir=$1 p f m have
  if ls .stage/whl/*.whl >/dev/null 2>&1; then  # wheels the image lacks (rapidfuzz)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/pydeps" .stage/whl/*.whl
  fi
  mkdir -p $PIECES "$SITE"
  cp "$dir"/* $PIECES/ || exit 3
  for p in A B C D; do
    f=$(ls $PIECES/"$p".of* 2>/dev/null | head -1)
    [ -n "$f" ] || continue
    m=${f#$PIECES/$p.of}; m=${m%%.*}
    have=$(ls $PIECES/"$p".of* | wc -l)
    if [ "$have" = "$m" ]; then
      cat $PIECES/"$p".of* | xz -dc | tar -x -C "$SITE" || exit 3
      rm -f $PIECES/"$p".of*; echo "unpacked $p into $SITE"
    fi
  done
  ls $PIECES "$SITE" | head -20
}

case "${1:-}" in
  run) shift; run "$@" ;;
  tp) shift; tp "$@" ;;
  pack) pack ;;
  merge) shift; cd "$R" && PYTHONPATH="$R${PYTHONPATH:+:$PYTHONPATH}" merge_corpora "$@" ;;
  unpack) shift; unpack "$@" ;;
  *) sed -n 2,40p "$0"; exit 2 ;;
esac
