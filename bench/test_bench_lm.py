"""SMC-shaped LM workload: genlm_fast's AsyncTransformer vs genlm-backend's, on SmolLM2 (or,
with ``--bench-model llama3.2-1b``, a seeded checkpoint of Llama-3.2-1B's architecture).

Run (CPU is fine; the model is prepared offline by `genlm_fast.models.smollm2_path`):

    python -m pytest bench/test_bench_lm.py --benchmark-only

(a few minutes on 2 CPU cores, most of it genlm-backend's plain runs; the summary table
is printed when ``test_genlm_fast`` finishes, before pytest-benchmark's own table).

Workload: 16 particles share a 15-token prompt. Each round, every particle asks
``next_token_logprobs`` for its context concurrently (auto-batched), then grows by one
token; 8 rounds. The tokens are drawn once, up front (seeded, from genlm_fast's own
distributions), and replayed by both backends, so both answer exactly the same queries.
Each timed run starts with cold caches. Both wrap their own float32 copy of the model,
loaded as genlm-backend's ``from_name`` does, from the local directory, with default
``batch_size=20`` and ``timeout=0.02``.

Two configurations of each backend, both timed:

* ``plain``: the queries alone (how genlm-control's samplers drive the LM: they never call
  ``cache_kv``). genlm-backend then keeps no key/value states between batches and runs every
  particle's whole context in every round; genlm_fast reuses them automatically.
* ``cache_kv``: the run starts with ``lm.cache_kv(prompt)`` (timed), genlm-backend's own,
  documented way to reuse the shared prompt's key/value states: its best configuration
  for this workload (it runs only the tokens past the prompt, about 4x less work here).

``--bench-dtype bfloat16`` loads both models in bfloat16, as ``dtype="auto"`` loads most hub
checkpoints (the float64 forward is then of the same bfloat16 weights).

Checked: every log-probability genlm_fast returns is within 1e-3 of a float64 forward
pass of the same weights (on tokens with log p > -20); genlm-backend's error is recorded
too. Every side gets one untimed warm-up run and the same number of timed runs. After
all ran, ``test_genlm_fast`` prints the throughput of each (particle-steps per second,
best run), the ratios of best runs (and of means) configuration by configuration, and the
headline: the best run of each backend in its best configuration. It asserts the goal on
that headline: genlm_fast >= 4x genlm-backend (and prints whether both plain reach 8x).
Other load on the machine inflates single runs; the best run is the figure to quote.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from bench.smc import N_PARTICLES, N_ROUNDS, draw_plan, float64_logprobs, max_error, run_cold

TOL = 1e-3
GOAL = 4.0  # each in its best configuration (genlm-backend's is cache_kv)
GOAL_PLAIN = 8.0  # both plain: genlm-backend as genlm-control drives it, out of the box
# timed runs of every side, after one untimed warm-up run (on an idle 2-core machine a
# genlm-backend run takes ~4 s plain, genlm_fast's under 1 s); the same for both backends,
# since the quoted figure is a best run and more runs would favour one side
ROUNDS = 3
WARMUP_ROUNDS = 1

_results = {}


@pytest.fixture(scope="module")
def dtype(request):
    return getattr(torch, request.config.getoption("--bench-dtype"))


@pytest.fixture(scope="module")
def ours(model_dir, dtype):
    from genlm_fast.backend.llm import AsyncTransformer

    lm = AsyncTransformer.from_name(model_dir, hf_opts={"dtype": dtype})
    lm.settle()  # (the steady state: the packed weights on their 2 MB pages)
    yield lm
    lm.cleanup()


@pytest.fixture(scope="module")
def theirs(model_dir, dtype):
    import genlm.backend.llm as llm  # the reference, a pinned bench dependency
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # genlm-backend's from_name, spelled out for a local directory
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, device_map="auto", dtype=dtype)
    return llm.AsyncTransformer(model, tok)


@pytest.fixture(scope="module")
def plan(ours):
    return draw_plan(ours)


@pytest.fixture(scope="module")
def reference(model_dir, plan, dtype):
    """Float64 log-probabilities of every planned context (one batch per round), by the
    benchmarked weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).double().eval()
    return float64_logprobs(model, plan)


def _bench(benchmark, model_name, name, lm, plan, reference, config="plain"):
    benchmark.extra_info["model"] = model_name
    benchmark.group = f"smc-{model_name}-16x8"
    answers = benchmark.pedantic(
        run_cold,
        args=(lm, plan, config == "cache_kv"),
        rounds=ROUNDS,
        iterations=1,
        warmup_rounds=WARMUP_ROUNDS,
    )
    err = max_error(answers, reference)
    steps = N_PARTICLES * N_ROUNDS
    mean, best = benchmark.stats.stats.mean, benchmark.stats.stats.min
    benchmark.extra_info.update(
        backend=name,
        config=config,
        dtype=str(next(lm.model.parameters()).dtype).removeprefix("torch."),
        particles=N_PARTICLES,
        rounds=N_ROUNDS,
        steps_per_s=round(steps / best, 2),
        max_abs_err_vs_f64=err,
    )
    _results[name, config] = {
        "mean_s": mean,
        "min_s": best,
        "steps_per_s": steps / best,
        "err": err,
    }
    return err


def test_genlm_backend(benchmark, model_name, theirs, plan, reference):
    _bench(benchmark, model_name, "genlm-backend", theirs, plan, reference)


def test_genlm_backend_cache_kv(benchmark, model_name, theirs, plan, reference):
    _bench(benchmark, model_name, "genlm-backend", theirs, plan, reference, "cache_kv")


def test_genlm_fast_cache_kv(benchmark, model_name, ours, plan, reference):
    err = _bench(benchmark, model_name, "genlm_fast", ours, plan, reference, "cache_kv")
    assert err < TOL, f"genlm_fast log-probs differ from float64 by {err:.2e}"


def test_genlm_fast(benchmark, model_name, model_label, ours, plan, reference, capsys):
    # (this name and configuration are the regression subset's: bench/conftest.py)
    err = _bench(benchmark, model_name, "genlm_fast", ours, plan, reference)
    assert err < TOL, f"genlm_fast log-probs differ from float64 by {err:.2e}"
    if any(name == "genlm-backend" for name, _ in _results):  # ran before: compare
        _summary(benchmark, model_label, capsys)


def _best(name):
    """(config, result) of ``name``'s fastest configuration (best run)."""
    runs = [(config, r) for (n, config), r in _results.items() if n == name]
    return min(runs, key=lambda cr: cr[1]["min_s"])


def _summary(benchmark, model_label, capsys):
    lines = [
        (
            f"SMC workload: {N_PARTICLES} particles x {N_ROUNDS} rounds, "
            f"{model_label} "
            f"{benchmark.extra_info['dtype']}, torch threads={torch.get_num_threads()}, "
            f"load average {os.getloadavg()[0]:.1f}"
        ),
        "| backend | config | min s/run | mean s/run | particle-steps/s (best run) "
        "| max abs err vs f64 |",
        "|---|---|---|---|---|---|",
    ]
    for (name, config), r in sorted(_results.items()):
        label = "genlm-backend 0.3.1" if name == "genlm-backend" else name
        lines.append(
            f"| {label} | {config} | {r['min_s']:.3f} | {r['mean_s']:.3f} | {r['steps_per_s']:.1f} "
            f"| {r['err']:.1e} |"
        )
    # Best-of-runs is the estimate least disturbed by other load on the machine.
    for config in ("plain", "cache_kv"):
        a, b = _results.get(("genlm-backend", config)), _results.get(("genlm_fast", config))
        if a and b:
            goal = (
                f"; goal >= {GOAL_PLAIN:.0f}x: "
                + ("met" if a["min_s"] >= GOAL_PLAIN * b["min_s"] else "NOT met")
                if config == "plain"
                else ""
            )
            lines.append(
                f"speedup, both {config}: {a['min_s'] / b['min_s']:.2f}x best run, "
                f"{a['mean_s'] / b['mean_s']:.2f}x mean{goal}"
            )
    (ref_config, a), (our_config, b) = _best("genlm-backend"), _best("genlm_fast")
    ratio, mean_ratio = a["min_s"] / b["min_s"], a["mean_s"] / b["mean_s"]
    benchmark.extra_info["speedup_vs_genlm_backend"] = round(ratio, 3)
    benchmark.extra_info["speedup_mean"] = round(mean_ratio, 3)
    benchmark.extra_info["configs"] = {"genlm-backend": ref_config, "genlm_fast": our_config}
    lines.append(
        f"speedup, each in its best configuration (genlm-backend {ref_config}, "
        f"genlm_fast {our_config}): {ratio:.2f}x best run, {mean_ratio:.2f}x mean "
        f"(goal >= {GOAL}x, best run)"
    )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert ratio >= GOAL, f"genlm_fast is only {ratio:.2f}x genlm-backend ({ref_config})"
