#!/usr/bin/env bash
# Run the test suite. Triton kernels run under the CPU interpreter unless a GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export TRITON_INTERPRET=1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
$PY -m pytest tests "$@"
if [ -x .venv-vllm/bin/python ]; then  # made by WITH_VLLM=1 scripts/setup.sh
  bash scripts/test_vllm.sh "$@"
else
  echo "== NOT RUN: the vLLM backend's tests (no .venv-vllm; WITH_VLLM=1 bash scripts/setup.sh builds it, CI does)" >&2
fi
# genlm's own test suites (from their sdists) on genlm_fast: what passes on genlm must pass here
bash scripts/test_genlm_suites.sh
