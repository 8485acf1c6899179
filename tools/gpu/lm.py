"""The LM on a GPU: genlm_fast's AsyncTransformer against genlm-backend's, and one decoding
forward run eagerly and replayed as a CUDA graph, on SmolLM2-135M's architecture.

    python -m tools.gpu.lm [--model-dir DIR] [--out PATH.md] [--rounds 3]
    python -m tools.gpu.lm --dry-run-cpu     # the same code path on CPU, a 2-layer model

SmolLM2's weights cannot reach the GPU machine (the smallest copy, a 96 MB GGUF, is over the
transfer limit), so the model there is SmolLM2's own config and tokenizer (``--model-dir``:
``tools/gpu/prepare.sh`` copies them into ``.whl/smollm2``) with seeded random weights.
Times depend on the shapes, not on the values; every answer is still checked against a
float64 forward of the same weights.

1. SMC: ``bench/smc.py``'s workload, that of ``bench/test_bench_lm.py`` (16 particles share
   a prompt, 8 rounds of concurrent ``next_token_logprobs`` and one more token each), every
   side on its own copy of the model, plain and with ``cache_kv(prompt)``, in interleaved
   rounds; best and mean run, and genlm_fast's largest error against float64 (it must stay
   under 1e-3). On a GPU genlm_fast runs three times: as it comes (its one-token steps
   replayed as CUDA graphs), with ``cuda_graphs=False``, and with ``paged_kv=True`` (the
   key/value states in a paged pool read in place; also in the CPU dry run).
2. One decoding forward of 1, 4 and 16 rows by one token over a 64-token past held in a
   transformers ``StaticCache``, float32 and bfloat16: eager, and captured once as a CUDA
   graph and replayed; both against the weight-streaming floor (the weights' bytes over the
   device's copy bandwidth, measured in the same run). A small model's eager forward is
   bound by kernel launches, not by memory: the ratio says how much a graph would give.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

PAST = 64
ROWS = (1, 4, 16)
TOL = 1e-3
EAGER = "genlm_fast, cuda_graphs=False"
PAGED = "genlm_fast, paged_kv=True"


def random_model(model_dir, layers=None, seed=0):
    """SmolLM2's architecture (``model_dir``'s config) with seeded random float32 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def smc(model, tokenizer, device, rounds):
    """Interleaved timed runs of the SMC workload by both backends, both configurations."""
    import genlm.backend.llm as reference

    from bench.smc import draw_plan, float64_logprobs, max_error, run_cold
    from genlm_fast.backend.llm import AsyncTransformer

    # genlm_fast's default (CUDA graphs where they apply), and on a GPU without them too
    ours = AsyncTransformer(copy.deepcopy(model).to(device), tokenizer)
    theirs = reference.AsyncTransformer(copy.deepcopy(model).to(device), tokenizer)
    backends = [("genlm_fast", ours), ("genlm-backend", theirs)]
    if device.type == "cuda":
        eager = AsyncTransformer(copy.deepcopy(model).to(device), tokenizer, cuda_graphs=False)
        backends.insert(1, (EAGER, eager))
    # the paged pool read in place (its steps replayed as graphs over block tables on a GPU)
    paged = AsyncTransformer(copy.deepcopy(model).to(device), tokenizer, paged_kv=True)
    backends.insert(1, (PAGED, paged))
    plan = draw_plan(ours)
    f64 = copy.deepcopy(model).double().to(device)
    expected = float64_logprobs(f64, plan)
    del f64
    sides = {(name, config): lm for name, lm in backends for config in ("plain", "cache_kv")}
    times = {side: [] for side in sides}
    errors = {}
    for round_ in range(rounds + 1):  # the first round warms up, untimed
        for (name, config), lm in sides.items():
            synchronize(device)
            start = time.perf_counter()
            answers = run_cold(lm, plan, config == "cache_kv")
            synchronize(device)
            if round_:
                times[name, config].append(time.perf_counter() - start)
            errors[name, config] = max_error(answers, expected)
    path = ours.forward_path
    for name, lm in backends:
        if name != "genlm-backend":
            lm.cleanup()
    del ours, theirs, backends, sides
    return times, errors, path, len(plan)


def smc_table(lines, times, errors, path, n_rounds, rounds):
    """Append the SMC section to ``lines``; whether genlm_fast's answers are within TOL."""
    lines += [
        f"## SMC: 16 particles x {n_rounds} rounds ({rounds} interleaved timed runs a side, "
        "after one untimed)",
        "",
        f"genlm_fast's forward path: {path}.",
        "",
        "| backend | config | best s/run | mean s/run | ms/round (best) | max abs err vs f64 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (side, config), runs in times.items():
        best = min(runs)
        lines.append(
            f"| {side} | {config} | {best:.4f} | {statistics.mean(runs):.4f} | "
            f"{1e3 * best / n_rounds:.2f} | {errors[side, config]:.1e} |"
        )
    best = {side: min(runs) for side, runs in times.items()}
    ours = [name for name, _ in times if name != "genlm-backend"]
    for name in dict.fromkeys(ours):
        for config in ("plain", "cache_kv"):
            ratio = best["genlm-backend", config] / best[name, config]
            lines.append(f"\nspeedup of {name} over genlm-backend, both {config}: {ratio:.2f}x")
        headline = min(best["genlm-backend", c] for c in ("plain", "cache_kv")) / min(
            best[name, c] for c in ("plain", "cache_kv")
        )
        lines.append(
            f"\n{name} over genlm-backend, each in its best configuration: "
            f"{headline:.2f}x (best runs)"
        )
    ok = all(errors[name, c] < TOL for name in ours for c in ("plain", "cache_kv"))
    if not ok:
        lines.append(f"\n**genlm_fast's error is over {TOL}: see the table.**")
    return ok


def copy_bandwidth(device, nbytes=1 << 30):
    """Bytes per second a device-to-device copy moves (read + write), median of 10."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    runs = []
    for _ in range(12):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        runs.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(runs[2:])


def timed(step, device, calls):
    """Seconds a call of ``step`` takes, calls issued back to back (launch-bound work shows)."""
    for _ in range(3):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def forward_times(model, device, rows, calls, graph):
    """(eager s, graph s or the reason there is none, largest graph/eager logit difference)
    of one forward of ``rows`` rows by one token over a ``PAST``-token StaticCache."""
    from transformers import StaticCache

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(rows)
    cache = StaticCache(config=model.config, max_cache_len=PAST + 1)
    with torch.no_grad():
        prefix = torch.randint(vocab, (rows, PAST), generator=gen).to(device)
        model(
            input_ids=prefix,
            past_key_values=cache,
            cache_position=torch.arange(PAST, device=device),
            use_cache=True,
        )
    step_ids = torch.randint(vocab, (rows, 1), generator=gen).to(device)
    position = torch.tensor([PAST], device=device)
    # transformers versions that count the cached length on the device (rather than take
    # cache_position) get it set back, so every call writes the same slot
    counters = [
        layer.cumulative_length
        for layer in getattr(cache, "layers", ())
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
    ]

    @torch.no_grad()
    def step():
        for counter in counters:
            counter.fill_(PAST)
        return model(
            input_ids=step_ids,
            past_key_values=cache,
            cache_position=position,
            use_cache=True,
            logits_to_keep=1,
        ).logits

    eager = timed(step, device, calls)
    if not graph:
        return eager, "not on CPU", None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            captured = step()
        cuda_graph.replay()
        diff = (captured.float() - step().float()).abs().max().item()
        return eager, timed(cuda_graph.replay, device, calls), diff
    except Exception as exc:  # noqa: BLE001 - the reason goes into the table
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return eager, f"capture failed: {reason}", None


def commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir",
        help="SmolLM2's config and tokenizer (default: the "
        ".whl/smollm2 copy, else genlm_fast.models.smollm2_path())",
    )
    parser.add_argument("--out", help="also write the table here (markdown)")
    parser.add_argument("--rounds", type=int, default=3, help="timed SMC rounds per side")
    parser.add_argument("--calls", type=int, default=50, help="forwards timed per shape")
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="on CPU, a 2-layer model, one round: this script's correctness",
    )
    args = parser.parse_args(argv)

    dry = args.dry_run_cpu
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or use --dry-run-cpu")
    device = torch.device("cpu" if dry else "cuda")
    model_dir = args.model_dir
    if model_dir is None:
        carried = REPO / ".whl" / "smollm2"
        if carried.is_dir():
            model_dir = str(carried)
        else:
            from genlm_fast.models import smollm2_path

            model_dir = smollm2_path(quiet=True)
    rounds, calls = (1, 3) if dry else (args.rounds, args.calls)

    import genlm.backend
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = random_model(model_dir, layers=2 if dry else None)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    name = "CPU (dry run)" if dry else torch.cuda.get_device_name(device)
    lines = [
        f"# The LM on a GPU: {name}, {datetime.date.today()}",
        "",
        f"- model: SmolLM2-135M's architecture ({model.config.num_hidden_layers} layers, "
        f"config and tokenizer from `{model_dir}`), seeded random weights, "
        f"{weight_bytes / 1e6:.0f} MB in float32",
        f"- torch {torch.__version__}, transformers "
        f"{__import__('transformers').__version__}, genlm-backend "
        f"{getattr(genlm.backend, '__version__', '0.3.1')}, genlm_fast at {commit()}",
        f"- command: `python -m tools.gpu.lm{' --dry-run-cpu' if dry else ''}`",
        "",
    ]

    try:
        times, errors, path, n_rounds = smc(model, tokenizer, device, rounds)
    except Exception:  # noqa: BLE001 - the forward timings below still run and report
        import traceback

        failure = traceback.format_exc()
        print(failure, file=sys.stderr)
        times = None
        lines += ["## SMC: failed", "", "```", *failure.splitlines()[-12:], "```"]
    if times is not None:
        ok = smc_table(lines, times, errors, path, n_rounds, rounds)
    else:
        ok = False

    bandwidth = copy_bandwidth(device, 1 << 26 if dry else 1 << 30)
    lines += [
        "",
        f"## One decoding forward: rows x 1 token over a {PAST}-token StaticCache",
        "",
        f"Copy bandwidth measured here: {bandwidth / 1e9:.0f} GB/s (read + write). The floor: "
        "the weights' bytes read once at that rate. Times are the mean of "
        f"{calls} forwards issued back to back.",
        "",
        "| dtype | rows | eager ms | CUDA graph ms | eager / graph | eager / floor "
        "| graph / floor | graph vs eager logits |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype in (torch.float32, torch.bfloat16):
        cast = copy.deepcopy(model).to(device=device, dtype=dtype)
        floor = sum(p.numel() * p.element_size() for p in cast.parameters()) / bandwidth
        for rows in ROWS[:2] if dry else ROWS:
            eager, graph, diff = forward_times(cast, device, rows, calls, graph=not dry)
            if isinstance(graph, float):
                cells = (
                    f"{1e3 * graph:.3f} | {eager / graph:.2f}x | {eager / floor:.1f}x | "
                    f"{graph / floor:.1f}x | {diff:.1e}"
                )
            else:
                cells = f"{graph} | | {eager / floor:.1f}x | | "
            lines.append(
                f"| {str(dtype).removeprefix('torch.')} | {rows} | {1e3 * eager:.3f} | {cells} |"
            )
        del cast

    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
