#!/usr/bin/env bash
# bundle_vllm.sh — a portable vLLM site tree for an air-gapped CUDA host that has Python and
# PyTorch but no vLLM and no network: built here (any machine with pip and PyPI), unpacked there
# into a folder put on PYTHONPATH. Nothing is installed on either side.
#
#   VLLM_VERSION=0.33.0 bash scripts/bundle_vllm.sh [DEST_DIR]      (default DEST_DIR: ./dist/vllm-$VLLM_VERSION)
#
# Environment (all optional):
#   VLLM_VERSION   the release (default 0.33.0)
#   PYVER          the host's Python, e.g. 3.12 (default 3.12): wheels are picked for it
#   SPLIT_MIB      split each archive into files of at most this many MiB (default 0: one file each),
#                  for media or transfers with a file-size limit; `cat` them back in order
#   XZ_LEVEL       xz preset (default 6)
#   EXTRA_WHEELS   more NAME==VERSION specs (space separated), e.g. flashinfer-python==0.7.2.post1
#   WORK           scratch folder (default /tmp/vllm-bundle-$VLLM_VERSION)
#
# What goes in: vLLM's Python package and its compiled extensions that a Hopper GPU needs
# (_C and _moe_C, both built on torch's stable ABI, and FlashAttention 3), and the pure-Python
# packages vLLM imports at module level that a plain PyTorch image lacks (PY_DEPS below: the
# ones seen missing on such an image, plus speccheck's rapidfuzz). Left out: FlashAttention 2
# (300 MB; FA3 covers Hopper), FlashMLA, QuTLASS, DeepGEMM, FlashInfer (add it with
# EXTRA_WHEELS; without it pass attention_backend=TRITON_ATTN and the Triton GDN prefill).
# vLLM pins one torch per release; its extensions link only torch's stable C ABI (check with
# `nm -D --undefined-only`), so a host's older torch may load them: that is the host's call,
# recorded in every run's identity (vllm_version, torch).
#
# Writes DEST_DIR/vllm-$VLLM_VERSION-py.tar.xz (Python packages, small extensions) and
# DEST_DIR/vllm-$VLLM_VERSION-ext.tar.xz (vLLM's extensions over 20 MB), each split into
# .partNN files when SPLIT_MIB is set. On the host, for each archive:
#   cat ARCHIVE.part* | xz -dc | tar -x -C SITE        then   export PYTHONPATH=SITE:$PYTHONPATH
set -euo pipefail

VLLM_VERSION=${VLLM_VERSION:-0.33.0}
PYVER=${PYVER:-3.12}
SPLIT_MIB=${SPLIT_MIB:-0}
XZ_LEVEL=${XZ_LEVEL:-6}
REPO=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
DEST=${1:-$REPO/dist/vllm-$VLLM_VERSION}
WORK=${WORK:-/tmp/vllm-bundle-$VLLM_VERSION}
mkdir -p "$DEST" "$WORK/wheels"

PLAT=()
for n in 17 24 26 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

PY_DEPS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 blake3==1.0.11 cachetools==8.0.2
  partial-json-parser==0.2.1.1.post7 openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  compressed-tensors==0.17.0 loguru==0.7.3 depyf==0.20.0 astor==0.8.1 dill==0.4.1 lark==1.2.2
  setproctitle==1.3.8 pybase64==1.5.1 python-json-logger==4.2.0 openai-harmony==0.0.8
  fastapi==0.136.3 starlette==1.10.0 opentelemetry-api==1.45.2 importlib-metadata==10.2.0
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6
  anthropic==2.14.0 docstring-parser==0.18.0 outlines-core==0.2.14 lm-format-enforcer==0.11.3
  interegular==0.3.3 gguf==0.19.0 mistral-common==1.13.1 pycountry==26.2.16
  pydantic-extra-types==2.11.1 jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1
  jsonschema-specifications==2025.9.1 diskcache==5.6.3 watchfiles==1.3.0 ijson==3.6.0
  prometheus-fastapi-instrumentator==8.1.0 frozendict==2.5.1 uvicorn==0.54.0
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
  python-multipart==0.0.34 cloudpickle orjson oss-harmony rapidfuzz==3.14.6
)
# shellcheck disable=SC2206
PY_DEPS+=(${EXTRA_WHEELS:-})

dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${PLAT[@]}" -d "$WORK/wheels" "$1" || { echo "download failed: $1" >&2; exit 1; }
}
echo "== vllm==$VLLM_VERSION and ${#PY_DEPS[@]} Python packages (cp${PYVER/./}, x86_64)"
dl "vllm==$VLLM_VERSION"
for s in "${PY_DEPS[@]}"; do dl "$s"; done

SITE=$WORK/site
rm -rf "$SITE" && mkdir -p "$SITE"
for w in "$WORK"/wheels/*.whl; do unzip -q -o "$w" -d "$SITE"; done
V=$SITE/vllm
rm -f "$V"/vllm_flash_attn/_vllm_fa2_C*.so "$V"/_flashmla*.so "$V"/_qutlass_C*.so "$V"/_flashkda*.so
rm -rf "$V/third_party/deep_gemm" "$V/third_party/fmha_sm100" "$V/vllm-rs"
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$SITE"

# two archives: vLLM's large compiled extensions, and everything else (a host can import and
# check vLLM's Python side with the first alone)
rm -f "$DEST"/vllm-"$VLLM_VERSION"-*.tar.xz*
(cd "$SITE" && find vllm -name '*.so' -size +20M | sort) > "$WORK/ext.list"
tar -C "$SITE" -cf - --exclude-from="$WORK/ext.list" . | xz -T0 -"$XZ_LEVEL" > "$DEST/vllm-$VLLM_VERSION-py.tar.xz"
tar -C "$SITE" -cf - -T "$WORK/ext.list" | xz -T0 -"$XZ_LEVEL" > "$DEST/vllm-$VLLM_VERSION-ext.tar.xz"
if [ "$SPLIT_MIB" -gt 0 ]; then
  for f in "$DEST"/vllm-"$VLLM_VERSION"-*.tar.xz; do
    split -b "${SPLIT_MIB}M" -d -a 2 "$f" "$f.part" && rm "$f"
  done
fi
ls -la "$DEST"
echo "files: $(ls "$DEST" | grep -c "^vllm-$VLLM_VERSION-")  total MiB: $(( $(cat "$DEST"/vllm-"$VLLM_VERSION"-* | wc -c) / 1048576 ))"
