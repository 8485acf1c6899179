"""CPU kernel microbenchmark: genlm_fast vs the genlm-backend references, side by side.

    python -m bench.kernels [--quick] [--out bench/results/cpu-<date>.md] [--plot PATH.png]

For every vocabulary, batch size B and operation (``sum`` = batch_weight_sum, ``max`` =
batch_weight_max, ``log_mass`` = batch_log_mass) it times, on the same inputs:

* ``genlm_fast``: ``genlm_fast.backend.trie.ParallelTokenCharacterTrie(device="cpu")``
  (float32 in and out, ``kernel_backend="auto"``); its float64 drop-in sibling
  ``TokenCharacterTrie`` is timed too (column "fast f64").
* ``numba``: ``genlm.backend.trie.TokenCharacterTrie`` (sequential, float64).
* ``sparse``: ``genlm.backend.trie.ParallelTokenCharacterTrie(device="cpu")`` (torch sparse).

The references have no log-mass op; their equivalent is ``log(batch_weight_sum(exp(log_softmax(
logits))))``. Every genlm_fast result is first checked against a float64 oracle (genlm's numba
trie fed float64 weights). Times are medians of ``time.perf_counter`` over back-to-back
calls, taken in rounds in which each implementation runs for ~0.2 s in turn (so that noise
hits them alike), each block after an untimed warm-up call; they hold for the machine
recorded in the header only.

Importable: ``run(quick) -> rows``, ``table(rows) -> markdown``, ``plot(rows, path)``.
The tries, inputs and oracle are `bench.tries` (shared with the pytest-benchmark suite and
``tools/gpu``); the vocabularies are ``bench/vocabs.py``, the machine description
``bench/machine.py``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from bench.machine import machine_info
from bench.report import command_line, write_report
from bench.tries import (
    OP_METHOD,
    OPS,
    Oracle,
    build_fast,
    build_reference,
    check_numbering,
    check_result,
    make_inputs,
    op_fn,
    op_input,
    ref_tokens,
)
from bench.vocabs import load_vocab

# the project's targets, all on the Llama-3 vocabulary: (op, B or None = every B, min speedup)
TARGETS = (("sum", 1, 10.0), ("sum", 32, 15.0), ("max", None, 5.0))
TARGET_VOCAB = "llama3"
BUILD_TARGET_S = 1.5  # construction of the trie and its kernel layout, no cache
# the genlm attributes a genlm_fast trie builds lazily (the "+ genlm attributes" column)
GENLM_ATTRIBUTES = ("children", "jump", "node2prefix", "leaf2word")


def genlm_attributes_seconds(trie) -> float:
    """Seconds to build the genlm attributes a genlm_fast trie makes lazily (``children``,
    ``jump``, ``node2prefix``, ``leaf2word``: genlm's constructors build them eagerly, and
    apps and the byte beam read them), on a freshly built ``trie``."""
    start = time.perf_counter()
    for name in GENLM_ATTRIBUTES:
        getattr(trie, name)
    return time.perf_counter() - start


# --------------------------------------------------------------------------- timing


def time_side_by_side(
    fns: dict, arg, *, target_s: float = 1.0, block_s: float = 0.2, min_rounds: int = 3
) -> dict:
    """``{name: median ms}`` over rounds in which each function in turn is called back to
    back for about ``block_s``: every function is timed in steady state, as pytest-benchmark
    does, while a burst of noise on this shared VM (it lasts seconds) falls on all of them
    alike rather than on whichever was being timed. The first call of every block is a
    warm-up (after another implementation ran, caches are cold and idle threads asleep) and
    is not timed. Rounds continue until every function has run ``target_s`` in all (at
    least ``min_rounds`` rounds)."""
    times = {name: [] for name in fns}
    rounds = 0
    while rounds < min_rounds or min(sum(ts) for ts in times.values()) < target_s:
        for name, fn in fns.items():
            fn(arg)
            block_start = time.perf_counter()
            while True:
                t = time.perf_counter()
                fn(arg)
                now = time.perf_counter()
                times[name].append(now - t)
                if now - block_start >= block_s:
                    break
        rounds += 1
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


# --------------------------------------------------------------------------- the benchmark


def run(
    quick: bool = False, vocabs=None, batch_sizes=None, ops=OPS, target_s=None, log=print
) -> list[dict]:
    """Time every (vocabulary, B, op); one row each (see the module docstring)."""
    vocabs = vocabs or (["llama3"] if quick else ["smollm2", "llama3", "o200k_base"])
    batch_sizes = batch_sizes or ([1, 32] if quick else [1, 8, 32, 128])
    target_s = target_s if target_s is not None else (0.5 if quick else 1.0)
    rows = []
    for name in vocabs:
        label, vocab = load_vocab(name)
        log(f"[{label}] {len(vocab)} tokens: building tries ...")
        ref_vocab = ref_tokens(vocab)
        t = time.perf_counter()
        numba_trie = build_reference(ref_vocab, "numba")
        numba_build = time.perf_counter() - t
        t = time.perf_counter()
        sparse_trie = build_reference(ref_vocab, "sparse")
        sparse_build = time.perf_counter() - t
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "auto" falling back: recorded below
            fast_builds, full_builds = [], []  # an absolute-time target on a noisy VM: median of 3
            for _ in range(3):
                t = time.perf_counter()
                fast = build_fast(vocab, "parallel", cache=False)
                fast_builds.append(time.perf_counter() - t)
                full_builds.append(fast_builds[-1] + genlm_attributes_seconds(fast))
            fast_build = statistics.median(fast_builds)
            full_build = statistics.median(full_builds)
            fast64 = build_fast(vocab, "char")
        check_numbering(fast, numba_trie)
        oracle = Oracle(numba_trie)
        log(
            f"[{label}] {fast.num_nodes} nodes; build s: genlm_fast {fast_build:.2f} (no cache; "
            f"{full_build:.2f} with genlm's attributes), numba {numba_build:.2f}, "
            f"sparse {sparse_build:.2f}"
        )
        for B in batch_sizes:
            logits, probs = make_inputs(len(vocab), B)
            for op in ops:
                x = op_input(op, logits, probs)
                want = oracle.expected(op, logits, probs)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    err = check_result(
                        op_fn(fast, op, False)(x), want, op, label=f"{label} {op} B={B}"
                    )
                    check_result(
                        op_fn(fast64, op, False)(x), want, op, label=f"{label} {op} B={B} f64"
                    )
                    ms = time_side_by_side(
                        {
                            "fast": op_fn(fast, op, False),
                            "fast64": op_fn(fast64, op, False),
                            "numba": op_fn(numba_trie, op, True),
                            "sparse": op_fn(sparse_trie, op, True),
                        },
                        x,
                        target_s=target_s,
                    )
                fast_ms, fast64_ms, numba_ms, sparse_ms = (
                    ms[k] for k in ("fast", "fast64", "numba", "sparse")
                )
                backend = fast.last_kernel_backend
                best_name, best_ms = min(
                    (("numba", numba_ms), ("sparse", sparse_ms)), key=lambda kv: kv[1]
                )
                row = {
                    "vocab": label,
                    "V": len(vocab),
                    "N": fast.num_nodes,
                    "op": op,
                    "B": B,
                    "fast_ms": fast_ms,
                    "fast64_ms": fast64_ms,
                    "numba_ms": numba_ms,
                    "sparse_ms": sparse_ms,
                    "best_ref": best_name,
                    "best_ref_ms": best_ms,
                    "speedup": best_ms / fast_ms,
                    "speedup64": best_ms / fast64_ms,
                    "max_rel_err": err,
                    "backend": backend,
                    "build_s": {
                        "genlm_fast": fast_build,
                        "genlm_fast+attrs": full_build,
                        "numba": numba_build,
                        "sparse": sparse_build,
                    },
                }
                rows.append(row)
                log(
                    f"[{label}] {op:8s} B={B:<4d} genlm_fast {fast_ms:9.3f} ms"
                    f"  f64 {fast64_ms:9.3f}  numba {numba_ms:9.3f}  sparse {sparse_ms:9.3f}"
                    f"  -> {row['speedup']:6.1f}x ({backend})"
                )
        del numba_trie, sparse_trie, fast, fast64, oracle
        gc.collect()
    return rows


def targets(rows) -> list[dict]:
    """The project's targets (Llama-3) against the measured rows."""
    out = []
    for op, B, need in TARGETS:
        hits = [
            r
            for r in rows
            if r["vocab"] == TARGET_VOCAB and r["op"] == op and (B is None or r["B"] == B)
        ]
        for r in hits:
            out.append(
                {
                    "target": f"{TARGET_VOCAB} {OP_METHOD[op]} B={r['B']} >= {need:g}x",
                    "speedup": r["speedup"],
                    "met": r["speedup"] >= need,
                    "need_ms": r["best_ref_ms"] / need,
                    "fast_ms": r["fast_ms"],
                }
            )
        if not hits:
            out.append(
                {
                    "target": f"{TARGET_VOCAB} {OP_METHOD[op]} B={B or 'any'} >= {need:g}x",
                    "speedup": None,
                    "met": None,
                    "need_ms": None,
                    "fast_ms": None,
                }
            )
    return out


def table(rows, info: dict | None = None, command: str | None = None) -> str:
    """Markdown: machine header, the timing table, the targets."""
    lines = []
    if info:
        lines.append("| | |")
        lines.append("|---|---|")
        for k, v in info.items():
            lines.append(f"| {k} | {v} |")
        lines.append("")
    if command:
        lines += [f"Command: `{command}`", ""]
    backends = sorted({r["backend"] for r in rows})
    lines.append(
        f"genlm_fast backend that ran: {', '.join(backends)}. Median ms per call on this "
        "machine; speedup = best genlm-backend reference / genlm_fast (float32 "
        '`ParallelTokenCharacterTrie`); "fast f64" is genlm_fast\'s float64 drop-in '
        "`TokenCharacterTrie`. References' log_mass = log(batch_weight_sum(exp(log_softmax))). "
        "Calls run back to back, so with OMP_WAIT_POLICY unset (see the header) the "
        "OpenMP threads are still spinning when the next call starts: small-B times "
        "are those of a caller whose threads are hot. With OMP_WAIT_POLICY=PASSIVE "
        "(the demo's and scripts/bench_regress.sh's setting) every call wakes them, "
        "which costs genlm_fast about 0.2-0.3 ms a call on this 2-core VM (numba, "
        "single-threaded, pays nothing)."
    )
    lines.append("")
    lines.append(
        "| vocab | op | B | genlm_fast ms | fast f64 ms | numba TCT ms | sparse PTCT ms "
        "| best ref | speedup | f64 speedup | max rel err |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['op']} | {r['B']} | {r['fast_ms']:.3f} | {r['fast64_ms']:.3f} | "
            f"{r['numba_ms']:.2f} | {r['sparse_ms']:.2f} | {r['best_ref']} | "
            f"{r['speedup']:.1f}x | {r['speedup64']:.1f}x | {r['max_rel_err']:.1e} |"
        )
    seen = {}
    for r in rows:
        seen.setdefault(r["vocab"], (r["V"], r["N"], r["build_s"]))
    lines += [
        "",
        (
            "Construction, seconds: genlm_fast's trie and kernel layout (no disk cache, "
            "median of 3); then the same plus the genlm attributes it builds lazily on "
            "first use (`children`, `jump`, `node2prefix`, `leaf2word`), which genlm's "
            "constructors build eagerly: the like-for-like comparison with the "
            "references' columns."
        ),
        "",
        (
            "| vocab | tokens | nodes | genlm_fast: trie + layout | + genlm attributes "
            "| numba | sparse |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for vocab, (V, N, b) in seen.items():
        full = b.get("genlm_fast+attrs")
        lines.append(
            f"| {vocab} | {V} | {N} | {b['genlm_fast']:.2f} | "
            f"{'-' if full is None else f'{full:.2f}'} | {b['numba']:.2f} | "
            f"{b['sparse']:.2f} |"
        )
    lines += [
        "",
        "Targets (Llama-3):",
        "",
        "| target | measured | met | genlm_fast ms | ms needed |",
        "|---|---:|---|---:|---:|",
    ]
    for t in targets(rows):
        if t["speedup"] is None:
            lines.append(f"| {t['target']} | not measured | - | - | - |")
        else:
            lines.append(
                f"| {t['target']} | {t['speedup']:.1f}x | {'yes' if t['met'] else 'NO'} | "
                f"{t['fast_ms']:.3f} | {t['need_ms']:.3f} |"
            )
    if TARGET_VOCAB in seen:
        build = seen[TARGET_VOCAB][2]["genlm_fast"]
        lines.append(
            f"| {TARGET_VOCAB} trie + layout construction <= {BUILD_TARGET_S:g} s | "
            f"{build:.2f} s | {'yes' if build <= BUILD_TARGET_S else 'NO'} | - | - |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, path) -> None:
    """PNG: speedup vs batch size, one line per (vocabulary, op), targets dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for vocab in dict.fromkeys(r["vocab"] for r in rows):
        for op in OPS:
            sel = sorted(
                (r for r in rows if r["vocab"] == vocab and r["op"] == op), key=lambda r: r["B"]
            )
            if sel:
                ax.plot(
                    [r["B"] for r in sel],
                    [r["speedup"] for r in sel],
                    marker="o",
                    label=f"{vocab} {op}",
                )
    for op, B, need in TARGETS:
        ax.axhline(need, ls="--", lw=0.8, color="grey")
        ax.annotate(
            f"target {op}{'' if B is None else f' B={B}'}: {need:g}x",
            (1, need),
            fontsize=7,
            color="grey",
            va="bottom",
        )
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["B"] for r in rows}))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks([0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 20, 50, 100, 200, 500])
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ys = [r["speedup"] for r in rows] + [need for _, _, need in TARGETS]
    ax.set_ylim(min(ys) / 1.3, max(ys) * 1.3)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("speedup vs best genlm-backend reference")
    ax.set_title("genlm_fast CPU vs genlm-backend (this machine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernels", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="llama3 only, B in {1, 32}")
    parser.add_argument(
        "--out", default=None, help="markdown output (default bench/results/cpu-<date>.md)"
    )
    parser.add_argument(
        "--plot", default=None, help="PNG of speedup vs B (default: --out with .png)"
    )
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--vocabs", nargs="+", default=None, help="override the vocabularies")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="override B")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (genlm_fast's cpu kernel and torch.sparse use it)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    info = machine_info()
    rows = run(args.quick, vocabs=args.vocabs, batch_sizes=args.batch_sizes, ops=args.ops)
    info["load average at end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    command = command_line("bench.kernels", argv)
    text = "# genlm_fast CPU kernels vs genlm-backend\n\n" + table(rows, info, command)
    print()
    out = write_report(text, args.out, "cpu")
    print(f"wrote {out}")
    if not args.no_plot:
        png = Path(args.plot) if args.plot else out.with_suffix(".png")
        plot(rows, png)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
