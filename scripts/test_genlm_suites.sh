#!/usr/bin/env bash
# Run genlm's own test suites against genlm_fast.
#
# Each suite comes from its PyPI source distribution (downloaded once into .genlm-suites/,
# gitignored; never copied into this repository) and runs twice, offline: with the real genlm
# packages, and with `-p genlm_fast.dropin` (genlm.backend / genlm.bytes imports resolve to
# genlm_fast), two runs at a time, each on a CPU of its own, where there are two CPUs. Each
# run records what genlm.backend / genlm.bytes resolved to: the drop-in run must be on this checkout's
# genlm_fast, the real run on genlm. The Hub models the suites load are offline stand-ins
# (scripts/make_hf_standins.py: the real tokenizers, small models of seeded random weights, in
# an HF cache of their own under .genlm-suites/hf-home). Every test that passes with the real
# packages must pass on genlm_fast (but for any listed, with its reason, in
# scripts/genlm_suite_outcomes.py); tests that
# fail with the real packages too (CUDA, vLLM, MLX, what only a trained model would say, ...)
# are not required. Each suite, and each file of it that matters, must also pass a minimum
# number of tests on both sides (MINIMUM_PASSED there), so pytest arguments that deselect
# tests make the check fail. Exit status 1 lists the tests that fail only on genlm_fast.
#
#   bash scripts/test_genlm_suites.sh                  # all suites
#   GENLM_SUITES="genlm-bytes==0.2.0" bash scripts/test_genlm_suites.sh
#
# The real packages must be installed at these versions (the `test` extra and scripts/setup.sh
# install them); extra arguments are passed to both pytest runs.
#
# genlm-control's whole suite runs for well over 20 minutes on a 2-core CPU (hypothesis-driven AWRS
# statistics); by default only its test files that reach genlm.backend / genlm.bytes code
# (PromptedLLM, ByteLLM, tokens, tries, canonical tokenization) run. GENLM_SUITES_FULL=1 runs all.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
CACHE=${GENLM_SUITES_CACHE:-$ROOT/.genlm-suites}
SUITES=${GENLM_SUITES:-"genlm-backend==0.3.1 genlm-bytes==0.2.0 genlm-control==0.4.1"}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export TRITON_INTERPRET=1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# genlm_fast from this checkout, and the outcome recorder (scripts/genlm_suite_outcomes.py)
export PYTHONPATH="$ROOT:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$CACHE/sdists" "$CACHE/results"
# The Hub models the suites load (gpt2, gpt2-medium, openai-community/gpt2, SmolLM-135M and
# its LoRA toys), as offline stand-ins: the real tokenizers, small models of seeded random
# weights (scripts/make_hf_standins.py), in an HF cache of their own
export HF_HOME="$CACHE/hf-home"
HF_HUB_DISABLE_PROGRESS_BARS=1 $PY -W ignore "$ROOT/scripts/make_hf_standins.py" "$HF_HOME" >/dev/null
# no ini file of genlm's applies, and this repository's pytest.ini must not: use one of our
# own, with only the per-test timeout (pytest-timeout, in the test extra): a hang fails
printf '[pytest]\ntimeout = 600\ntimeout_method = thread\n' > "$CACHE/pytest.ini"

fetch() {  # fetch SPEC BASE: the sdist's tests (everything but the genlm/ sources) in $CACHE/BASE
  local spec=$1 base=$2 tmp
  [ -d "$CACHE/$base/tests" ] && return 0
  if [ ! -f "$CACHE/sdists/$base.tar.gz" ]; then
    $PY -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
      "$spec" -d "$CACHE/sdists"
  fi
  tmp=$(mktemp -d "$CACHE/.extract.XXXXXX")
  # without genlm/: the real run must import the installed package, never the sdist's copy
  tar -xzf "$CACHE/sdists/$base.tar.gz" -C "$tmp" --exclude="$base/genlm"
  rm -rf "${CACHE:?}/$base"
  mv "$tmp/$base" "$CACHE/$base"
  rmdir "$tmp"
}

run_suite() {  # run_suite BASE LABEL [pytest args...]: outcomes to results/BASE.LABEL.json
  local base=$1 label=$2
  shift 2
  (cd "$CACHE/$base" &&
    GENLM_SUITE_OUTCOMES="$CACHE/results/$base.$label.json" ${PIN:-} $PY -m pytest $TESTS \
      -c "$CACHE/pytest.ini" --rootdir "$CACHE/$base" -p no:cacheprovider \
      -p genlm_suite_outcomes "$@") || true  # failures are judged by the comparison
}

# test files to run per suite (default: the whole tests/ folder)
declare -A SELECTION=(
  [genlm-control]="tests/potential/test_bytellm.py tests/potential/test_canonical.py
    tests/potential/test_coerce.py tests/potential/test_duplicate_byte_strings.py
    tests/potential/test_ensemble.py tests/potential/test_harmony.py tests/potential/test_llm.py
    tests/sampler/test_unit_sampler.py tests/test_setups.py tests/test_util.py"
)
if [ "${GENLM_SUITES_FULL:-0}" = "1" ]; then
  SELECTION=()
fi

# the CPUs this process may run on (two or more: two runs at once)
mapfile -t CPUS < <($PY -c "import os; print(*sorted(os.sched_getaffinity(0)), sep='\n')" \
  2>/dev/null || true)
command -v taskset >/dev/null 2>&1 && command -v flock >/dev/null 2>&1 || CPUS=()

status=0
summary=()
ready=()  # the suites fetched, as BASE NAME SPEC
declare -A TESTS_OF
for spec in $SUITES; do
  name=${spec%%==*}
  version=${spec##*==}
  base="${name//-/_}-$version"
  installed=$($PY -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || true)
  if [ "$installed" != "$version" ]; then
    echo "ERROR: $spec is not installed (found '${installed:-none}'): its suite needs the real" \
         "package; run scripts/setup.sh" >&2
    status=1
    summary+=("$name: not run ($spec not installed)")
    continue
  fi
  fetch "$spec" "$base"
  TESTS_OF[$base]=${SELECTION[$name]:-tests}
  rm -f "$CACHE/results/$base".*
  ready+=("$base $name $spec")
done

# Every suite's two runs (real, dropin) are jobs, started longest first (genlm-control's,
# then genlm-bytes', then genlm-backend's; the real packages' side is the slower) by two
# lanes that each take the next job when their last one ends. Each lane is pinned to a CPU
# of its own (taskset); a real run may also use the CPUs past the first two. genlm_fast sizes
# its threads by the CPUs that other work leaves free; on one CPU of its own that size, and
# so its answers' rounding, does not change with the other lane's load (genlm's tests ask
# for answers bit-identical between calls). With fewer than two CPUs, one job after the
# other. Output files and logs are separate, printed suite by suite.
jobs=()
for entry in "${ready[@]}"; do
  jobs+=("${entry%% *} real" "${entry%% *} dropin")
done
mapfile -t jobs < <(printf '%s\n' "${jobs[@]}" | awk '{
  print ($1 ~ /^genlm_control/ ? 0 : $1 ~ /^genlm_bytes/ ? 1 : 2), $0}' | sort -s -n -k1,1 |
  cut -d' ' -f2-)

run_job() {  # run_job BASE LABEL [pytest args...], pinned by $PIN
  local base=$1 label=$2 begin=$SECONDS
  shift 2
  local plugin=()
  [ "$label" = dropin ] && plugin=(-p genlm_fast.dropin)
  TESTS=${TESTS_OF[$base]} run_suite "$base" "$label" "${plugin[@]}" -q --tb=no "$@" \
    > "$CACHE/results/$base.$label.log" 2>&1
  echo $((SECONDS - begin)) > "$CACHE/results/$base.$label.seconds"
}

queue="$CACHE/results/.next-job"
lane() {  # lane CPUS_OF_REAL_RUNS CPU_OF_DROPIN_RUNS [pytest args...]
  local real_cpus=$1 dropin_cpu=$2 i base label cpus
  shift 2
  while true; do
    i=$({ flock 9; read -r n < "$queue"; echo $((n + 1)) > "$queue"; echo "$n"; } 9> "$queue.lock")
    [ "$i" -lt ${#jobs[@]} ] || return 0
    read -r base label <<< "${jobs[$i]}"
    if [ "$label" = real ]; then cpus=$real_cpus; else cpus=$dropin_cpu; fi
    PIN="taskset -c $cpus" run_job "$base" "$label" "$@"
  done
}

if [ ${#CPUS[@]} -ge 2 ]; then
  echo 0 > "$queue"
  extra=$(IFS=,; echo "${CPUS[*]:2}")
  lane "${CPUS[0]}${extra:+,$extra}" "${CPUS[0]}" "$@" &
  lane "${CPUS[1]}${extra:+,$extra}" "${CPUS[1]}" "$@" &
  wait
  rm -f "$queue" "$queue.lock"
  lanes=", two lanes"
else
  for job in "${jobs[@]}"; do
    read -r base label <<< "$job"
    run_job "$base" "$label" "$@"
  done
  lanes=""
fi

for entry in "${ready[@]}"; do
  read -r base name spec <<< "$entry"
  echo "=== $spec: real packages"
  cat "$CACHE/results/$base.real.log"
  echo "=== $spec: genlm_fast (-p genlm_fast.dropin)"
  cat "$CACHE/results/$base.dropin.log"
  real_s=$(cat "$CACHE/results/$base.real.seconds")
  dropin_s=$(cat "$CACHE/results/$base.dropin.seconds")
  report="$CACHE/results/$base.compare.txt"
  ok=1
  $PY "$ROOT/scripts/genlm_suite_outcomes.py" compare "$name" "$CACHE/results/$base.real.json" \
    "$CACHE/results/$base.dropin.json" "$CACHE/results/$base.regressed.txt" > "$report" || ok=0
  cat "$report"
  summary+=("$(head -n 1 "$report")  (${real_s}s real, ${dropin_s}s dropin${lanes})")
  if [ $ok -eq 0 ]; then
    status=1
    if [ -s "$CACHE/results/$base.regressed.txt" ]; then
      echo "=== $spec: tracebacks of the tests failing only on genlm_fast (first 20)"
      mapfile -t ids < <(head -n 20 "$CACHE/results/$base.regressed.txt")
      (cd "$CACHE/$base" && $PY -m pytest -c "$CACHE/pytest.ini" --rootdir "$CACHE/$base" \
        -p no:cacheprovider -p genlm_fast.dropin -q --tb=short "${ids[@]}") || true
    fi
  fi
done

echo "=== genlm suites on genlm_fast"
printf '  %s\n' "${summary[@]}"
if [ $status -ne 0 ]; then
  echo "FAILED: see the listing above" >&2
fi
exit $status
