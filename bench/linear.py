"""CPU linear-layer microbenchmark: the kernels `AsyncTransformer` can run a decoding step on.

    python -m bench.linear [--rows 1,4,9,16,20,24,32,48,64] [--out bench/results/linear-<date>.md]

One "step" is every linear product of a SmolLM2-135M forward pass on ``rows`` rows: 30 layers
of q, k, v, o (576 -> 576, 192, 192, 576), gate, up (576 -> 1536) and down (1536 -> 576), then
the LM head (576 -> 49152); 538 MB of float32 weights, random, each layer its own, so that as
in a real forward pass the weights come from memory, not from cache. Kernels, on the same
inputs:

* ``torch``: ``F.linear`` (MKL's sgemm): torch's own CPU linear layer;
* ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on weights reordered once (a copy), the
  op behind torch.compile's CPU linear fusion, for comparison;
* ``avx512``: genlm_fast's small-batch kernel (``csrc/linear_cpu.cpp``) on its packed panels,
  where the CPU has AVX-512F (`genlm_fast.backend.llm.cpu_linear`'s choice up to
  ``cpu_linear.SMALL_BATCH_ROWS`` rows);
* ``rows``: ``genlm_fast._C.linear_rows`` (``csrc/linear_rows_cpu.cpp``) on the weights in
  place, where the CPU has AVX2 (the choice without AVX-512, up to ``widen.ROWS`` rows).

Each kernel's products are first checked against float64 on one layer of each shape. Times:
median of 7 steps, after a warm-up step, taken in two rounds in turn (the best round kept), on
the machine in the header only. GB/s: the weights' bytes over the step's time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.machine import machine_line
from bench.report import write_report

LAYERS = 30
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
HEAD = (49152, 576)
ROWS = (1, 4, 9, 16, 20, 24, 32, 48, 64)


def _kernels():
    """name -> (pack(weight) -> packed, run(x, packed, out_features) -> y), those that run."""
    from genlm_fast.backend.llm import cpu_linear

    found = {"torch": (lambda w: w, lambda x, w, n: F.linear(x, w))}
    runs = cpu_linear.available_kernels()
    if torch.backends.mkldnn.is_available():
        found["onednn"] = (
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
            lambda x, p, n: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
        )
    if "avx512" in runs:
        module = cpu_linear._small_batch_module()
        found["avx512"] = (
            module.pack_linear_weight,
            lambda x, p, n: module.linear_small_batch(x, p, None, n, "avx512"),
        )
    if "rows" in runs:
        from genlm_fast.ops import extension

        module = extension.load_module()
        found["rows"] = (lambda w: w, lambda x, w, n: module.linear_rows(x, w, None, "auto"))
    return found


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    layers = [[torch.randn(n, k, generator=g) * k**-0.5 for n, k in SHAPES] for _ in range(LAYERS)]
    return layers, torch.randn(*HEAD, generator=g) * HEAD[1] ** -0.5


def _check(name, pack, run, layers, rows):
    for w in layers[0]:
        x = torch.randn(rows, w.shape[1])
        got = run(x, pack(w), w.shape[0]).double()
        want = x.double() @ w.double().t()
        err = float((got - want).abs().max())
        if err > 1e-4:
            raise AssertionError(f"{name}: {rows} x {tuple(w.shape)} is off by {err:.2e}")


def run(rows=ROWS):
    """[(rows, {kernel: ms per step})] and the step's weight bytes."""
    layers, head = _weights()
    kernels = _kernels()
    packed = {
        name: ([[pack(w) for w in ws] for ws in layers], pack(head))
        for name, (pack, _) in kernels.items()
    }
    nbytes = sum(w.numel() for ws in layers for w in ws) * 4 + head.numel() * 4
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        for name, (pack, run_one) in kernels.items():
            _check(name, pack, run_one, layers, m)

        def step(name, xs=xs):
            run_one = kernels[name][1]
            body, head_packed = packed[name]
            for ws in body:
                for (n, k), w in zip(SHAPES, ws):
                    run_one(xs[k], w, n)
            run_one(xs[576], head_packed, HEAD[0])

        best = {}
        for _ in range(2):
            for name in kernels:
                step(name)
                times = []
                for _ in range(7):
                    t = time.perf_counter()
                    step(name)
                    times.append(time.perf_counter() - t)
                ms = sorted(times)[3] * 1e3
                best[name] = min(best.get(name, ms), ms)
        out.append((m, best))
    return out, nbytes


def table(results, nbytes):
    names = list(results[0][1])
    lines = [
        "SmolLM2-135M's linear layers, one decoding step (30 layers + LM head, "
        f"{nbytes / 1e6:.0f} MB of float32 weights): median ms per step, and GB/s of weights",
        "",
        "| rows | " + " | ".join(names) + " | fastest vs torch |",
        "|---:|" + "---:|" * len(names) + "---:|",
    ]
    for m, ms in results:
        cells = [f"{ms[n]:.1f} ({nbytes / ms[n] / 1e6:.0f} GB/s)" for n in names]
        fastest = min(ms, key=ms.get)
        lines.append(
            f"| {m} | " + " | ".join(cells) + f" | {fastest} {ms['torch'] / ms[fastest]:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rows",
        default=",".join(map(str, ROWS)),
        help="comma-separated row counts (default: %(default)s)",
    )
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    results, nbytes = run(rows)
    text = f"# CPU linear kernels\n\n{machine_line()}\n\n{table(results, nbytes)}\n"
    write_report(text, args.out)


if __name__ == "__main__":
    main()
