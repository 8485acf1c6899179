#!/usr/bin/env bash
# Run genlm_fast's vLLM backend tests in the separate vLLM environment.
# Set it up first with: bash scripts/setup_vllm.sh   (VENV=... for another location)
# Extra arguments go to pytest (default: -q).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$(pwd)/.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  echo "no vLLM environment at $VENV: run bash scripts/setup_vllm.sh first" >&2
  exit 1
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
if [ $# -eq 0 ]; then set -- -q; fi
exec "$VENV/bin/python" -m pytest tests/vllm "$@"
