#!/usr/bin/env bash
# Run the test suite. Triton kernels run under the CPU interpreter unless a GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export TRITON_INTERPRET=1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Three stages; all of them always run, and any failing fails the script. The vLLM backend's
# tests run in their own environment (a venv of their own, one engine process) from the
# start, beside the main suite, whose workers leave part of the CPUs idle; genlm's own test
# suites (what passes on genlm must pass on genlm_fast) come after the main suite, their runs
# each pinned to a CPU of its own, so what they compute does not depend on the other stages'
# load. The vLLM tests' output comes last.
status=0
vllm_pid=
vllm_log=
if [ -x .venv-vllm/bin/python ]; then  # made by WITH_VLLM=1 scripts/setup.sh
  vllm_log=$(mktemp "${TMPDIR:-/tmp}/genlm_fast_vllm.XXXXXX")
  bash scripts/test_vllm.sh "$@" > "$vllm_log" 2>&1 &
  vllm_pid=$!
else
  echo "== NOT RUN: the vLLM backend's tests (no .venv-vllm; WITH_VLLM=1 bash scripts/setup.sh builds it, CI does)" >&2
fi
# The main suite on as many pytest-xdist workers as the CPUs this process may use (at most 4:
# each worker loads its own models), a test file wholly on one worker (--dist loadfile), so a
# module's fixtures (model loads, trie builds, the compat tests' worker processes) are made
# once. Files start in the order tests/conftest.py gives (the longest first, so that none is
# left to run alone at the end). Without pytest-xdist (the test extra installs it) it runs in
# one process.
if $PY -c "import xdist" 2>/dev/null; then
  workers=$($PY -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
  PARALLEL=(-n "$workers" --dist loadfile --no-loadscope-reorder)
else
  echo "== the main suite in one process: pytest-xdist is not installed (pip install -e '.[test]')" >&2
  PARALLEL=()
fi
echo "== the main suite (tests/)"
$PY -m pytest tests "${PARALLEL[@]}" "$@" || status=$?
echo "== genlm's test suites (scripts/test_genlm_suites.sh)"
suites_status=0
bash scripts/test_genlm_suites.sh || suites_status=$?
[ $status -ne 0 ] || status=$suites_status
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
