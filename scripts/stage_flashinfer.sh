#!/usr/bin/env bash
# stage_flashinfer.sh — FlashInfer for the offline H200 (vLLM 0.26's default GDN prefill
# backend on SM90), as part D next to ../shared/tools/stage-vllm.sh's parts A, B, C:
#
#   bash scripts/stage_flashinfer.sh [STAGE_DIR]     (default .stage; must be git-ignored)
#
# vLLM 0.26.0 requires flashinfer-python==0.6.14. On SM90 its GDN prefill
# (flashinfer/gdn_prefill.py -> gdn_kernels/delta_rule_dsl/delta_rule_sm90.py) is a CuTe-DSL
# kernel compiled at first use through MLIR: no nvcc, but nvidia-cutlass-dsl and its native
# libraries (libs-cu13: ~237 MB unpacked, the bulk of this part), apache-tvm-ffi (FlashInfer's
# JIT module loader) and cuda-tile; and quack-kernels, which vLLM 0.26 requires: once cutlass
# imports, its kernel warm-up (the CuTe-DSL router GEMM) imports quack, and without it every
# engine start fails (seen on the H200). vLLM 0.26 pins nvidia-cutlass-dsl 4.6.0; 4.8.1 is what
# ran there. cudnn-frontend is left out (imported lazily, only by FlashInfer's cuDNN attention).
# Python reads the .pth file that puts cutlass on the path only in site-packages: the scripts
# add $SITE/nvidia_cutlass_dsl/dsl_packages to PYTHONPATH. The kernel supports head dim 128 only (see README: the
# reference checkpoint is exported padded to 128 for it). The wheels are unzipped into one
# site tree and packed with xz; `scripts/h200_vllm.sh pack` splits it into transfer pieces
# with A, B, C, and `unpack` extracts it into $SITE on the GPU host.
set -euo pipefail
REPO=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
STAGE=${1:-$REPO/.stage}
WORK=${WORK:-/tmp/flashinfer-stage}
mkdir -p "$STAGE/D" "$WORK/wheels" "$WORK/site"
WHEELS=(flashinfer-python==0.6.14 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0
        nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1
        quack-kernels==0.6.5)
for w in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$WORK/wheels" "$w"
done
for f in "$WORK"/wheels/*.whl; do python3 -m zipfile -e "$f" "$WORK/site"; done
# aarch64/QNX runtime stubs are of no use on the x86-64 host
rm -rf "$WORK"/site/nvidia_cutlass_dsl/*/lib/stubs
tar -C "$WORK/site" -cf - . | xz -T0 -9 > "$STAGE/D/D.tar.xz"
ls -la "$STAGE/D/D.tar.xz"
