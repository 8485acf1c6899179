#!/usr/bin/env bash
# On a GPU machine reached through a remote runner (tools/gpu/README.md):
#     bash tools/gpu/session.sh tests    # build with the CUDA kernels, run the GPU tests
#     bash tools/gpu/session.sh bench    # python -m tools.gpu.bench --sweep (Llama-3)
#     bash tools/gpu/session.sh lm       # python -m tools.gpu.lm: the LM's SMC step and one
#                                          #   decoding forward, eager and as a CUDA graph
#     bash tools/gpu/session.sh profile  # ncu on the CUDA kernels (and their DRAM traffic
#                                          # with the caches as the pipeline leaves them,
#                                          # and what the tile and span kernels wait on)
#     bash tools/gpu/session.sh all      # all in one remote call: build, lm (at most
#                                          # LM_S = 120 s), bench, profile (at most
#                                          # PROFILE_S = 80 s), tests
# Each step installs what it needs first (once per machine): the wheels that
# tools/gpu/prepare.sh put in .whl/ (carried), and genlm_fast with its CUDA extension.
# Logs and results go to $OUT, which the runner sends back.
#
# The GPU machine (H100/H200, Python 3.12, torch with CUDA, Triton, nvcc) has no internet and
# lacks a few packages: first, here, `bash tools/gpu/prepare.sh` puts their wheels in .whl/
# (~5 MB); then run `all` as one remote command carrying [".whl"] (a machine goes back
# 30 s after a call, so two calls usually mean two builds; `all` bounds the benchmark and the
# tests with timeouts that share what the build leaves of TOTAL_S = 585 s (BENCH_S and
# TESTS_S override them), to fit the 10-minute limit; PYTEST_ARGS adds pytest arguments,
# BENCH_ARGS replaces the benchmark's --sweep). What
# comes back: the benchmark table, the test log, env.txt and, if a test crashed the
# interpreter, its C stack (crash.txt); the rest (build log, test reports, the sm_90 compile
# table, the ncu reports ncu-*.txt) in logs.tar.gz, as the tool brings back 8 files. Commit
# the table under bench/results/.
# SmolLM2's vocabulary cases are left out there (its tokenizer ships in a 96 MB GGUF, over
# the transfer limit).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH  # ninja from .whl: torch's extension build runs it
PY=python3
GPU_TESTS="tests/ops/test_trie_reduce.py tests/ops/test_triton_kernels.py
  tests/ops/test_log_softmax_rows.py tests/ops/test_extension_build.py
  tests/ops/test_extension_numerics.py tests/ops/test_cuda_compile.py tests/ops/test_layout.py
  tests/backend/test_cuda_graphs.py tests/ops/test_paged_attention.py
  tests/backend/test_paged_kv.py"

# whether genlm_fast._C holds CUDA kernels built from the csrc/ here (GENLM_FAST_NO_JIT:
# the probe must not JIT-build the CPU kernels instead)
cuda_kernels_current() {
  GENLM_FAST_NO_JIT=1 $PY -c "import sys; from genlm_fast.ops import extension as e
sys.exit(0 if e.has('cuda') and not e.stale_reason() else 1)" 2>/dev/null
}

setup() {
  if [ ! -f /tmp/site/.done ]; then
    [ -d .whl ] || { echo "no .whl/: run tools/gpu/prepare.sh here and carry .whl" >&2; exit 1; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && touch /tmp/site/.done || exit 1
  fi
  if ! cuda_kernels_current; then
    echo "== building genlm_fast with its CUDA kernels (log: $OUT/install.log)"
    # sm_90 (H100/H200) unless told otherwise; ninja builds the three sources in parallel
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
      $PY -m pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
      || { tail -40 "$OUT/install.log"; exit 1; }
    # setup.py falls back to the CPU kernels when the CUDA build fails: say so loudly (the
    # Triton and CPU tests still run), with nvcc's/g++'s errors from the log
    if ! cuda_kernels_current; then
      echo "!! genlm_fast._C was built WITHOUT the CUDA kernels; the build log says:" >&2
      grep -n -E "error|Error|WARNING \(genlm_fast\)" "$OUT/install.log" | head -40 >&2
    fi
  fi
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    git rev-parse HEAD 2>/dev/null
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    $PY -c "from genlm_fast.ops import dispatch; print('backends on cuda:', dispatch.available_backends('cuda'))"
    echo "profilers: $(command -v ncu nsys compute-sanitizer | tr '\n' ' ')"
  } | tee "$OUT/env.txt"
}

# The C stack of the test $1, which kills the interpreter: gdb's where there is one
# ($GDB, default gdb), else glibc's backtrace from tools/gpu/segv_stack.c (LD_PRELOAD), its
# frames in genlm_fast's extension named by addr2line.
native_stack() {
  local python stack
  python=$($PY -c "import sys; print(sys.executable)")  # not a shim script
  if command -v "${GDB:-gdb}" >/dev/null; then
    timeout 120 "${GDB:-gdb}" -q -batch -ex run -ex bt --args "$python" -m pytest -q \
      -p no:cacheprovider "$1" 2>&1 | sed -n '/received signal/,$p' | head -40
  elif cc -shared -fPIC -O1 -o /tmp/segv_stack.so tools/gpu/segv_stack.c; then
    # -s: pytest must not capture fd 2, where the handler writes
    stack=$(LD_PRELOAD=/tmp/segv_stack.so timeout 120 "$python" -m pytest -q -s \
      -p no:cacheprovider "$1" 2>&1 | sed -n '/Fatal Python error/,$p' | head -120)
    echo "$stack"
    echo "$stack" | grep -oE '^[^ ()]*genlm_fast[^ ()]*\.so\(\+0x[0-9a-f]+\)' \
      | sed -E 's/\(\+(0x[0-9a-f]+)\)$/ \1/' | while read -r module offset; do
        printf '%s %s: ' "$module" "$offset"; addr2line -f -C -e "$module" "$offset" | paste -sd' '
      done
  fi
}

run_tests() {
  # tests/ops: every kernel test with the compiled Triton and CUDA backends, real
  # vocabularies included, the trie tests first; then the LM's CUDA graphs; SmolLM2's vocabulary comes from a 96 MB GGUF
  # that cannot travel, so its cases are left out. test_cuda_emulation.py (the .cu on the
  # CPU) and test_triton_sm90.py (compiles for sm_90 without a GPU) need no GPU: CI runs
  # them, here they would only take the time. The sm_90 compile report uses this triton.
  $PY tests/ops/test_triton_sm90.py >"$OUT/sm90-compile.txt" 2>&1
  # A test that kills the interpreter (a signal: rc > 128) would end the run there; its
  # C stack goes to $OUT/crash.txt (native_stack) and the run goes on with the
  # tests not yet run (tools/gpu/session_progress.py lists the finished ones), up to 3 times.
  # pytest's faulthandler names the test in the log, which collects every attempt (each
  # attempt has its own XML report).
  local deselect=() crashes=() rc crashed done_log="$OUT/tests-done.txt"
  : >"$done_log"; : >"$done_log.failures"
  for attempt in 1 2 3 4; do
    PYTEST_DONE_LOG=$done_log \
      $PY -m pytest ${TEST_PATHS:-$GPU_TESTS} -q -ra -k "not smollm2" \
      -p no:cacheprovider -p tools.gpu.session_progress --durations=10 \
      --junitxml="$OUT/tests-ops-$attempt.xml" ${PYTEST_ARGS:-} "${deselect[@]}" 2>&1 \
      | tee -a "$OUT/tests-ops.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -le 128 ] || [ "$attempt" -eq 4 ]; then
      [ "$rc" -eq 0 ] && [ ${#crashes[@]} -gt 0 ] && rc=1  # the crashes still count
      return "$rc"
    fi
    crashed=$(grep -oE 'tests/[A-Za-z0-9_/]+\.py", line [0-9]+ in test_[A-Za-z0-9_]+' \
      "$OUT/tests-ops.log" | tail -1 | sed -E 's/", line [0-9]+ in /::/')
    [ -n "$crashed" ] || return "$rc"
    echo "!! $crashed killed pytest (rc $rc); its stack: $OUT/crash.txt; going on without it"
    echo "== $crashed" >>"$OUT/crash.txt"
    native_stack "$crashed" >>"$OUT/crash.txt" 2>&1
    crashes+=(--deselect "$crashed")
    deselect=("${crashes[@]}")
    while IFS= read -r id; do deselect+=(--deselect "$id"); done <"$done_log"
  done
}

run_profile() {
  # ncu on the third call's row pass, tile and span kernels (tools/gpu/profile_call.py: the CUDA
  # log_mass at B=64 and sum at B=32, the goals' shapes; 3 of them per call: at these
  # batches the row pass stages the rows, and for log_mass also takes the partial lse);
  # where the machine withholds the performance counters, the report says so
  local ncu op batch per_call
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  [ -x "$ncu" ] || { echo "no ncu on this machine"; return 0; }
  for shape in "log_mass 64 3" "sum 32 3"; do
    read -r op batch per_call <<<"$shape"
    "$ncu" --kernel-name regex:'row_pass|tile_kernel|span_kernel' \
      --launch-skip $((2 * per_call)) --launch-count "$per_call" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section WarpStateStats $PY -m tools.gpu.profile_call --op "$op" --batch "$batch" \
      >"$OUT/ncu-$op-B$batch.txt" 2>&1
    echo "ncu $op B=$batch: exit $? ($OUT/ncu-$op-B$batch.txt)"
  done
  # The DRAM traffic of each kernel of the third call as the pipeline leaves the L2 to it
  # (--cache-control none: no flush between kernels; three counters, one pass): whether the
  # staged rows, the scratch and the span pass's writes reach DRAM at all. log_mass runs 4
  # kernels a call (row pass, lse merge, tile, span), sum 3.
  for shape in "log_mass 64 4" "sum 32 3"; do
    read -r op batch per_call <<<"$shape"
    "$ncu" --cache-control none --kernel-name regex:'row_pass|row_lse_merge|tile_kernel|span_kernel' \
      --launch-skip $((2 * per_call)) --launch-count "$per_call" \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      $PY -m tools.gpu.profile_call --op "$op" --batch "$batch" \
      >"$OUT/ncu-pipeline-$op-B$batch.txt" 2>&1
    echo "ncu (caches kept) $op B=$batch: exit $? ($OUT/ncu-pipeline-$op-B$batch.txt)"
  done
  # What the tile and span kernels' warps wait on (log_mass B=64, the third call): each
  # stall reason's warps per issued instruction, one counter a reason
  "$ncu" --kernel-name regex:'tile_kernel|span_kernel' --launch-skip 4 --launch-count 2 \
    --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
    $PY -m tools.gpu.profile_call --op log_mass --batch 64 >"$OUT/ncu-stalls-log_mass-B64.txt" 2>&1
  echo "ncu stalls log_mass B=64: exit $? ($OUT/ncu-stalls-log_mass-B64.txt)"
}

run_lm() {
  # genlm_fast's AsyncTransformer against genlm-backend's (SMC), and one decoding forward
  # eager and as a CUDA graph, on SmolLM2's architecture with random weights (tools/gpu/lm.py)
  $PY -m tools.gpu.lm --out "$OUT/gpu-lm-$(date +%F).md" 2>&1 | tee "$OUT/lm-gpu.log"
  return "${PIPESTATUS[0]}"
}

run_bench() {
  # --sweep: after the main table (written first), the Triton kernels' launch configurations
  $PY -m tools.gpu.bench ${BENCH_ARGS---sweep} --out "$OUT/gpu-$(date +%F).md" 2>&1 | tee "$OUT/bench-gpu.log"
  return "${PIPESTATUS[0]}"
}

# The runner brings back at most 8 files: the table, the test log, the environment and
# a crash report stay as they are, everything else goes into $OUT/logs.tar.gz.
bundle_outputs() {
  local rest
  rest=$(cd "$OUT" && ls -A | grep -v -E '^(gpu-.*\.md|tests-ops\.log|env\.txt|crash\.txt|logs\.tar\.gz)$')
  [ -n "$rest" ] || return 0
  (cd "$OUT" && tar czf logs.tar.gz $rest && rm -rf $rest)
}
trap bundle_outputs EXIT

case "${1:-}" in
  tests) setup; run_tests; exit $? ;;
  bench) setup; run_bench; exit $? ;;
  lm) setup; run_lm; exit $? ;;
  profile) setup; run_profile; exit $? ;;
  all)
    setup
    export -f run_lm run_bench run_profile run_tests native_stack
    export OUT PY GPU_TESTS
    timeout "${LM_S:-120}" bash -c run_lm; lm_rc=$?
    # what the build left of TOTAL_S (the runner's 600 s, less a margin for the
    # transfers): 53% to the benchmark, the rest to the tests, unless BENCH_S/TESTS_S say
    left=$(( ${TOTAL_S:-585} - SECONDS )); [ "$left" -ge 120 ] || left=120
    timeout "${BENCH_S:-$(( left * 53 / 100 ))}" bash -c run_bench; bench_rc=$?
    timeout "${PROFILE_S:-80}" bash -c run_profile
    left=$(( ${TOTAL_S:-585} - SECONDS )); [ "$left" -ge 60 ] || left=60
    timeout "${TESTS_S:-$left}" bash -c run_tests; tests_rc=$?
    echo "== lm exit $lm_rc, bench exit $bench_rc, tests exit $tests_rc (124: stopped by its timeout)"
    exit $(( lm_rc || bench_rc || tests_rc ))
    ;;
  *)
    echo "usage: bash tools/gpu/session.sh tests|bench|lm|profile|all" >&2
    exit 2
    ;;
esac
