#!/usr/bin/env bash
# Performance regression check: genlm_fast's own benchmarks against this machine's last baseline.
#
#   bash scripts/bench_regress.sh              # compare the working tree with the latest saved
#                                              # baseline; exit 1 if a median regressed > 10%
#                                              # (in each of up to 3 runs; see BENCH_ATTEMPTS)
#   bash scripts/bench_regress.sh save         # run the same benchmarks, save them as a new baseline
#   bash scripts/bench_regress.sh compare -k llama3   # anything after the mode goes to pytest
#
# The subset (bench/conftest.py, --bench-regress): trie kernels (smollm2 and llama3
# vocabularies, B in {1, 32}, sum / max / log_mass, the three genlm_fast tries), the
# SMC-shaped AsyncTransformer workload, the byte-level beam and genlm-control's example
# programs (bench/programs.py) on SmolLM2; no reference package is timed (genlm-backend's
# numba trie is built once, untimed, as the oracle; the beam's result is checked against one
# untimed genlm-bytes run, ~15 s more). About 3.5 minutes on a 2-core CPU (the programs
# ~40 s of it).
#
# Baselines live in bench/results/baselines/<machine key>/<pytest-benchmark machine id>/,
# one JSON per saved run (NNNN_<commit>[-dirty]_<date>.json) with machine_info (CPU, cores,
# CUDA device, torch, threads, backends) and commit_info (git id, dirty) plus a genlm_fast
# block (commit, load average). The machine key is the CPU model, core count and GPU name:
# timings only compare on the same kind of machine, so each kind keeps its own baselines.
# Save a baseline on an idle machine only (the script warns when the load is high).
#
# Environment:
#   BENCH_STORAGE      baseline folder (default bench/results/baselines/<machine key>)
#   BENCH_THRESHOLD    allowed median regression (default 10%)
#   BENCH_ATTEMPTS     runs before a regression counts (default 3): after the first run only
#                      the benchmarks over the threshold run again, and a benchmark regresses
#                      only if its median is over the threshold in every run
#                      (scripts/bench_compare.py). Even idle, this 2-core VM put 1-4 of the 38
#                      medians of an unchanged tree 13-32% over its baseline in one run;
#                      under a load of 3-5, sub-millisecond medians moved by up to 55%.
#   BENCH_MAX_TIME     pytest-benchmark --benchmark-max-time per kernel benchmark (default 1.5 s)
#   BENCH_MIN_ROUNDS   pytest-benchmark --benchmark-min-rounds (default 15)
#   GENLM_FAST_BENCH_ROUNDS  timed runs of the beam benchmark (default here 3)
#   OMP_WAIT_POLICY    default here PASSIVE: idle OpenMP threads sleep instead of spinning.
#                      On a shared 2-core machine (load ~5) spinning threads made B=1 kernels
#                      40x slower (12-24 ms instead of 0.3 ms) with medians swinging 2x from
#                      run to run. Recorded in machine_info: compare only runs made with
#                      the same setting.
#   BENCH_CONTENTION   1 (default): after a comparison, also print the contention report
#                      (python -m bench.contention --quick: each workload idle, beside a busy
#                      loop, a 2-thread torch process and another genlm_fast LM program,
#                      genlm_fast and the references; about 6 minutes on 2 cores; a report,
#                      it does not fail the check; with OMP_WAIT_POLICY as the caller set
#                      it, unset by default); 0: not
#   PYTHON             interpreter (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

mode=${1:-compare}
if [ $# -gt 0 ]; then shift; fi
case "$mode" in
  compare|save) ;;
  -h|--help|help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: $0 [compare|save] [pytest args...]" >&2; exit 2 ;;
esac

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export GENLM_FAST_BENCH_ROUNDS=${GENLM_FAST_BENCH_ROUNDS:-3}
wait_policy_given=${OMP_WAIT_POLICY+yes}  # the contention report runs with the caller's own
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export TRITON_INTERPRET=1
fi

key=$($PY -c 'from bench.conftest import machine_key; print(machine_key())')
storage=${BENCH_STORAGE:-bench/results/baselines/$key}
threshold=${BENCH_THRESHOLD:-10%}

cores=$(nproc)
load=$(cut -d' ' -f1 /proc/loadavg)
echo "machine key: $key   baselines: $storage   load average: $load ($cores cores)"
if awk -v l="$load" -v c="$cores" 'BEGIN { exit !(l > c / 2) }'; then
  echo "warning: the machine is busy (load $load on $cores cores): timings will be noisy;" \
       "do not save a baseline now, and read a failed comparison with care." >&2
fi

files=(bench/test_bench_tries.py bench/test_bench_lm.py bench/test_bench_beam.py
  bench/test_bench_programs.py)
args=(
  -q -p no:cacheprovider --benchmark-only --bench-regress
  "--benchmark-max-time=${BENCH_MAX_TIME:-1.5}"
  "--benchmark-min-rounds=${BENCH_MIN_ROUNDS:-15}"
  --benchmark-disable-gc --benchmark-sort=fullname
  --benchmark-columns=min,median,iqr,rounds
)

if [ "$mode" = save ]; then
  name=$(git rev-parse --short HEAD 2>/dev/null || echo nogit)
  if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    name="$name-dirty"
  fi
  name="${name}_$(date +%Y%m%d-%H%M%S)"
  exec $PY -m pytest "${files[@]}" "${args[@]}" "--benchmark-storage=file://$storage" \
    "--benchmark-save=$name" "$@"
fi

if ! ls "$storage"/*/[0-9][0-9][0-9][0-9]_*.json >/dev/null 2>&1; then
  echo "no baseline for this machine in $storage: run \`bash scripts/bench_regress.sh save\`" \
       "on an idle machine first" >&2
  exit 2
fi
latest=$(ls "$storage"/*/[0-9][0-9][0-9][0-9]_*.json | sort | tail -n 1)
attempts=${BENCH_ATTEMPTS:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
contention_report() {
  if [ "${BENCH_CONTENTION:-1}" = 0 ]; then return; fi
  echo "== contention report (python -m bench.contention --quick)"
  local unset=()
  if [ -z "$wait_policy_given" ]; then unset=(-u OMP_WAIT_POLICY); fi
  local rc=0
  env "${unset[@]}" $PY -m bench.contention --quick --out "$work/contention.md" || rc=$?
  case $rc in
    0) ;;
    3) echo "(contention goals not all met: see the report above)" ;;
    *) echo "(the contention report failed to run: exit status $rc)" ;;
  esac
}
echo "comparing with $latest (median regression > $threshold, up to $attempts runs)"
targets=("${files[@]}")
for i in $(seq 1 "$attempts"); do
  $PY -m pytest "${targets[@]}" "${args[@]}" "--benchmark-json=$work/run$i.json" "$@"
  rc=0
  $PY scripts/bench_compare.py "$latest" "$work"/run*.json --threshold "${threshold%\%}" \
    --failing "$work/failing" || rc=$?
  if [ "$rc" -eq 0 ]; then contention_report; fi
  if [ "$rc" -ne 1 ]; then exit "$rc"; fi
  mapfile -t targets < "$work/failing"
  if [ "$i" -lt "$attempts" ]; then
    echo "== ${#targets[@]} over the threshold: running them again (attempt $((i + 1)) of $attempts)"
  fi
done
contention_report
echo "FAILED: performance regressed against the baseline (over +$threshold in all $attempts runs)" >&2
exit 1
