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
# Then the vLLM backend's tests and genlm's own test suites (what passes on genlm must pass
# on genlm_fast) at the same time: they share nothing (the vLLM tests run in their own
# environment), and genlm's suites pin each of their runs to a CPU of its own, so what they
# compute does not depend on the other stage's load. The vLLM tests' output comes after
# genlm's; both stages always run, and either failing fails the script.
vllm_pid=
vllm_log=
if [ -x .venv-vllm/bin/python ]; then  # made by WITH_VLLM=1 scripts/setup.sh
  vllm_log=$(mktemp "${TMPDIR:-/tmp}/genlm_fast_vllm.XXXXXX")
  bash scripts/test_vllm.sh "$@" > "$vllm_log" 2>&1 &
  vllm_pid=$!
else
  echo "== NOT RUN: the vLLM backend's tests (no .venv-vllm; WITH_VLLM=1 bash scripts/setup.sh builds it, CI does)" >&2
fi
status=0
bash scripts/test_genlm_suites.sh || status=$?
if [ -n "$vllm_pid" ]; then
  vllm_status=0
  wait "$vllm_pid" || vllm_status=$?
  echo "=== the vLLM backend's tests (scripts/test_vllm.sh)"
  cat "$vllm_log"
  rm -f "$vllm_log"
  if [ $vllm_status -ne 0 ]; then
    echo "FAILED: the vLLM backend's tests (exit status $vllm_status)" >&2
    [ $status -ne 0 ] || status=$vllm_status
  fi
fi
exit $status
