"""Byte-level beam: genlm_fast.bytes vs genlm-bytes 0.2.0, on the real SmolLM2-135M-Instruct
(or, with ``--bench-model llama3.2-1b``, the seeded Llama-3.2-1B architecture as
``dtype="auto"`` loads it: bfloat16).

    python -m pytest bench/test_bench_beam.py --benchmark-only -s
    python -m pytest bench/test_bench_beam.py --benchmark-only -s --bench-model llama3.2-1b

Workload (K=5): from the beam after BOS, prefill a 24-byte prompt, then advance byte by byte
through a 40-byte continuation, reading ``logp_next`` before every byte and once at the end
(41 reads). genlm-bytes runs on genlm-backend's ``AsyncTransformer``, genlm_fast.bytes on
genlm_fast's, both built from the same local model directory with default batching
settings (genlm_fast's loading settled: its packed weights on their 2 MB pages, as in the
SMC benchmark). Each timed run starts with cold LM caches (output and key/value caches cleared,
then the BOS beam built, untimed). Trie construction is not timed (genlm_fast keeps one
trie per model; the genlm-bytes trie is built once here too).

Checked: the final ``logZ`` and next-byte distribution of both agree (`TOLERANCE`: 1e-2 /
2e-3 on SmolLM2, 0.5 on the bfloat16 Llama-3 checkpoints, where genlm-backend computes in
bfloat16); under ``--bench-regress``, which times genlm_fast only, against one untimed
genlm-bytes run. The summary (best and mean run of each, the ratio, the fused path's
counters) is printed when the module finishes; the goal is genlm_fast >= 5x (6x on the
Llama-3 checkpoints).

Environment:
    GENLM_FAST_BENCH_DEVICE   "cpu" (default) or "cuda": where the models (and so the
                              logits and trie masses) live.
    GENLM_FAST_BENCH_THREADS  torch intra-op threads (default: torch's choice). On a
                              shared, loaded machine, 1 is far less noisy.
    GENLM_FAST_BENCH_ROUNDS   timed runs per implementation (default 2; one warm-up more).
    GENLM_FAST_BENCH_LM_TIMEOUT  the auto-batching wait of both LMs, in seconds (default:
                              each library's default, 0.02). Each beam step submits its
                              whole batch at once, so a single beam waits this long per
                              LM call for nothing; 0 shows the beams without that wait.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from bench.beams import advance, beam_maker

PROMPT = b"The capital of France is"  # 24 bytes
CONTINUATION = b" Paris, and the capital of Italy is Rome"  # 40 bytes
K = 5
GOAL = {"smollm2": 5.0, "llama3.2-1b": 6.0, "llama3.1-8b": 6.0}  # x genlm-bytes, best runs
DEVICE = os.environ.get("GENLM_FAST_BENCH_DEVICE", "cpu")
ROUNDS = int(os.environ.get("GENLM_FAST_BENCH_ROUNDS", "2"))
LM_TIMEOUT = os.environ.get("GENLM_FAST_BENCH_LM_TIMEOUT")

assert len(PROMPT) == 24 and len(CONTINUATION) == 40

_results = {}


def _threads():
    value = os.environ.get("GENLM_FAST_BENCH_THREADS")
    if value:
        torch.set_num_threads(int(value))
    return torch.get_num_threads()


@pytest.fixture(scope="module")
def report(model_name, model_label):
    """Prints the side-by-side summary once both implementations ran."""
    yield _results
    if not _results:
        return
    lines = [
        "",
        (
            f"byte-level beam, {model_label}, K={K}, device={DEVICE}, "
            f"torch threads={torch.get_num_threads()}, LM timeout="
            f"{LM_TIMEOUT if LM_TIMEOUT is not None else 'default'}, load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
        ),
        (
            f"workload: prefill {len(PROMPT)} bytes + {len(CONTINUATION)} byte steps, "
            f"logp_next at each ({len(CONTINUATION) + 1} reads)"
        ),
        "",
        "| implementation | best (s) | mean (s) | CPU s (best run) | runs |",
        "|---|---|---|---|---|",
    ]
    for name, r in _results.items():
        lines.append(
            f"| {name} | {min(r['wall']):.2f} | {np.mean(r['wall']):.2f} | "
            f"{r['cpu'][int(np.argmin(r['wall']))]:.2f} | {len(r['wall'])} |"
        )
    if {"genlm_fast.bytes", "genlm-bytes"} <= _results.keys():
        fast, ref = _results["genlm_fast.bytes"], _results["genlm-bytes"]
        best = min(ref["wall"]) / min(fast["wall"])
        mean = np.mean(ref["wall"]) / np.mean(fast["wall"])
        cpu = min(ref["cpu"]) / min(fast["cpu"])
        lines += [
            "",
            (
                f"speedup (best runs): {best:.2f}x, (means): {mean:.2f}x, "
                f"(CPU time): {cpu:.2f}x; goal >= {GOAL[model_name]:.0f}x: "
                f"{'met' if best >= GOAL[model_name] else 'NOT met'}"
            ),
        ]
    stats = _results.get("genlm_fast.bytes", {}).get("stats")
    if stats:
        lines.append(
            "genlm_fast fused path, per run: " + ", ".join(f"{k}={v}" for k, v in stats.items())
        )
    print("\n".join(lines))


def _load(cls, model_dir):
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("GENLM_FAST_BENCH_DEVICE asks for CUDA, which is not available")
    kwargs = {} if LM_TIMEOUT is None else {"timeout": float(LM_TIMEOUT)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_name(model_dir, hf_opts={"device_map": DEVICE}, **kwargs)


@pytest.fixture(scope="module")
def fast_lm(model_dir):
    from genlm_fast.backend.llm import AsyncTransformer

    lm = _load(AsyncTransformer, model_dir)
    lm.settle()  # (the steady state: loading's background work done)
    yield lm
    lm.cleanup()


@pytest.fixture(scope="module")
def ref_lm(model_dir):
    import genlm.backend.llm as llm  # the references, pinned bench dependencies
    import genlm.bytes  # noqa: F401

    return _load(llm.AsyncTransformer, model_dir)


async def _run(beam):
    """The timed workload; returns the last next-byte log-probabilities and the beam."""
    last, beam = await advance(beam, PROMPT, CONTINUATION)
    return np.asarray(last.ps, dtype=np.float64), beam


def _measure(benchmark, name, lm, make_beam, model_name):
    """Run the workload ``ROUNDS`` times (plus one warm-up), cold LM caches each time."""
    loop = asyncio.new_event_loop()
    walls, cpus, outputs = [], [], []

    def setup():
        lm.clear_cache()
        gc.collect()
        beam = loop.run_until_complete(make_beam())
        return (beam,), {}

    def work(beam):
        wall, cpu = time.perf_counter(), time.process_time()
        ps, final = loop.run_until_complete(_run(beam))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        outputs.append((ps, float(final.logZ)))
        return final

    try:
        benchmark.group = f"beam-{model_name}-K{K}-{DEVICE}"
        benchmark.extra_info.update(device=DEVICE, K=K, threads=_threads())
        final = benchmark.pedantic(work, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    finally:
        loop.close()
    walls, cpus = walls[1:], cpus[1:]  # the first call was the warm-up
    _results[name] = {"wall": walls, "cpu": cpus, "output": outputs[-1]}
    benchmark.extra_info.update(best_s=min(walls), cpu_s=min(cpus), logZ=outputs[-1][1])
    return final


@pytest.fixture(scope="module")
def ref_make_beam(ref_lm):
    """genlm.bytes.ByteBeamState.initial, with the trie built once (untimed)."""
    return beam_maker("genlm", ref_lm, K, device=DEVICE)


# how far genlm_fast's final logZ and next-byte log-probabilities (of the bytes either gives
# over 1e-4) may lie from genlm-bytes': SmolLM2 runs in float32 on both sides; the Llama-3
# checkpoints load in bfloat16, whose forward genlm-backend computes in bfloat16 (about half
# a nat from float64 on a token of the 1B) and genlm_fast in float32 (1e-4)
TOLERANCE = {"smollm2": (1e-2, 2e-3), "llama3.2-1b": (0.5, 0.5), "llama3.1-8b": (0.5, 0.5)}


def _check_against_other(request):
    """genlm_fast's final logZ and next-byte distribution against genlm-bytes' (within
    `TOLERANCE`): its timed run when both ran, else (--bench-regress, which times genlm_fast
    only) one untimed run of genlm-bytes here."""
    if "genlm_fast.bytes" not in _results:
        return
    if "genlm-bytes" in _results:
        expected = _results["genlm-bytes"]["output"]
    elif request.config.getoption("--bench-regress"):
        ref_lm = request.getfixturevalue("ref_lm")
        make_beam = request.getfixturevalue("ref_make_beam")
        loop = asyncio.new_event_loop()
        try:
            qs, final = loop.run_until_complete(_run(loop.run_until_complete(make_beam())))
        finally:
            loop.close()
            ref_lm.clear_cache()
        expected = (qs, float(final.logZ))
    else:
        return  # genlm-bytes' own test compares, once it has run
    (ps, z), (qs, zq) = _results["genlm_fast.bytes"]["output"], expected
    big = (np.exp(ps) > 1e-4) | (np.exp(qs) > 1e-4)
    z_err, byte_err = abs(z - zq), float(np.max(np.abs(ps[big] - qs[big])))
    print(
        f"\ngenlm_fast vs genlm-bytes: logZ {z:.4f} vs {zq:.4f}, "
        f"next byte max |diff| {byte_err:.2e}"
    )
    z_tol, byte_tol = TOLERANCE[request.getfixturevalue("model_name")]
    assert z_err <= z_tol, (z, zq)
    assert byte_err <= byte_tol, byte_err


def test_beam_genlm_fast(benchmark, report, fast_lm, model_name, request):
    from genlm_fast.bytes import fused_stats

    make_beam = beam_maker("genlm_fast", fast_lm, K)

    async def counters():
        return dict(fused_stats(await make_beam()))

    loop = asyncio.new_event_loop()
    before = loop.run_until_complete(counters())
    loop.close()
    final = _measure(benchmark, "genlm_fast.bytes", fast_lm, make_beam, model_name)
    after = fused_stats(final)
    runs = ROUNDS + 1
    _results["genlm_fast.bytes"]["stats"] = {
        k: round((after[k] - before[k]) / runs, 1) for k in after if k != "memo_hits"
    }
    _check_against_other(request)


def test_beam_genlm_bytes(benchmark, report, ref_lm, ref_make_beam, model_name, request):
    _measure(benchmark, "genlm-bytes", ref_lm, ref_make_beam, model_name)
    _check_against_other(request)
