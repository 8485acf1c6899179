"""GPU benchmark of the fused trie kernels: time, bytes moved, bandwidth, speedup vs genlm.

    python -m tools.gpu.bench [--out PATH.md] [--vocab llama3 | --vocab-file vocab.pkl]
                        [--batch-sizes 1 8 32 64 128] [--backends triton cuda] [--peak-gbs 3350]
    python -m tools.gpu.bench --dump-vocab vocab.pkl   # (where quicktok is) for --vocab-file
    python -m tools.gpu.bench --dry-run-cpu            # the same code path on CPU, tiny vocabulary
    python -m tools.gpu.bench --sweep                  # also: the Triton launch configurations

For every available GPU backend (``triton``, ``cuda``), batch size and op it
1. checks the result against a float64 oracle computed with the reference's own ancestor
   matrix (genlm.backend's when it imports: independent of genlm_fast's layout), in float64
   (the run stops on a mismatch: relative error <= 1e-5 of every node mass >= 1e-30);
2. times the public call (``TokenByteTrie(device="cuda").batch_log_mass`` / ``batch_weight_sum``
   / ``batch_weight_max``: input validation + kernels, result left on the device) and the
   kernels alone (the backend's ``trie_reduce``), with ``triton.testing.do_bench`` (median;
   L2 flushed between runs) or CUDA events;
3. reports the compulsory traffic — logits/weights read once (B * V' * 4 bytes), node values
   written once (B * N * 4), the backend's index arrays read once — the effective bandwidth
   (traffic / time) of the kernels and of the public call (which also checks each row for
   NaN: the CUDA kernels' row pass does, for Triton the dispatcher makes one more read of
   the input), and their fractions of the device's peak HBM bandwidth;
4. at B=64, profiles each backend's kernels (torch.profiler): the time of each kernel of
   its chain, to show where the time goes;
5. times the memory floors (``memory_floors``) at the goals' shapes: torch's own kernels
   writing the output once, reading the input once, copying it, and gathering it into
   [B, N], for the fraction of peak that moving that traffic alone gets on the device; then
   the same bytes moved in the CUDA tile kernel's pattern, with no reduction
   (tools/gpu/tile_floors.py), for what that pattern alone costs;
6. with ``--sweep``, times the Triton tile kernels in each launch configuration of
   ``TRITON_SWEEP`` (rows per program, warps, chunk sizes), to choose the defaults from.
The reference is genlm.backend's ``ParallelTokenCharacterTrie(device="cuda")`` when
``genlm.backend`` imports (its own ancestor matrix), else the same algorithm inline (a torch
sparse CSR ancestor matrix [V, N], ``torch.sparse.mm(ws[:, positions], M)``; for max its
``scatter_reduce`` amax); its device time (for log_mass: log_softmax, exp, sparse.mm, log) is
what the speedup compares with (the headline: batch_weight_sum at B=32). At that B the full
API calls are compared too, on equal terms: genlm's ``batch_weight_sum`` (rows stacked,
product, numpy copy on the host) against genlm_fast's drop-in
``ParallelTokenCharacterTrie(device="cuda").batch_weight_sum``, which also returns numpy.

This module runs the table's measurements (``run``) and the command line; the parts live
beside it: the vocabulary (`tools.gpu.trie_vocab`), the timer, the bytes moved and the peak
(`tools.gpu.measure`), the reference and its oracle (`tools.gpu.trie_reference`), the goals
(`tools.gpu.goals`), the memory floors (`tools.gpu.memory_floors`), the sweep
(`tools.gpu.sweep`) and the markdown (`tools.gpu.table`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# (after the checkout's path)
from tools.gpu.goals import GOAL_PEAK_B, SPEEDUP_B  # noqa: E402
from tools.gpu.measure import (  # noqa: E402
    bench_ms,
    detect_peak,
    index_arrays,
    index_bytes,
    io_bytes,
    kernel_breakdown,
    kernel_call,
    timer_name,
)
from tools.gpu.memory_floors import memory_floors  # noqa: E402
from tools.gpu.sweep import triton_sweep  # noqa: E402
from tools.gpu.table import table  # noqa: E402
from tools.gpu.trie_reference import Reference  # noqa: E402
from tools.gpu.trie_vocab import DRY_RUN_TOKENS, dump_vocab, load_vocab  # noqa: E402

OPS = ("log_mass", "sum", "max")
GPU_BACKENDS = ("triton", "cuda")
DEFAULT_BATCHES = (1, 8, 32, 64, 128)
DRY_RUN_BATCHES = [1, 32]


def run(args) -> tuple[list[dict], dict]:
    import numpy as np
    import torch

    from bench import machine
    from bench.tries import OP_METHOD, check_result, make_inputs
    from genlm_fast.backend.trie import ParallelTokenCharacterTrie
    from genlm_fast.bytes import TokenByteTrie
    from genlm_fast.ops import dispatch

    dry = args.dry_run_cpu
    device = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or use --dry-run-cpu")
    label, vocab = load_vocab(
        args.vocab, args.vocab_file, limit=args.limit or (DRY_RUN_TOKENS if dry else None)
    )
    available = dispatch.available_backends(device)
    wanted = args.backends or (available if dry else list(GPU_BACKENDS))
    backends = [b for b in wanted if b in available]
    skipped = [b for b in wanted if b not in available]
    if not backends:
        raise SystemExit(f"none of {wanted} is available on {device} (available: {available})")
    print(
        f"vocabulary {label}: {len(vocab)} tokens; device {device}; backends {backends}"
        + (f" (not available: {skipped})" if skipped else ""),
        flush=True,
    )

    t = time.perf_counter()
    tries = {b: TokenByteTrie(vocab, device=device.type, kernel_backend=b) for b in backends}
    build_s = time.perf_counter() - t
    # genlm.backend's API (numpy on the host) for the like-for-like full-call comparison
    drop_in = {
        b: ParallelTokenCharacterTrie(vocab, device=device.type, kernel_backend=b) for b in backends
    }
    layout = next(iter(tries.values())).layout
    N = layout.num_nodes
    t = time.perf_counter()
    ref = Reference(vocab, layout, device, inline=args.inline_reference)
    ref_build_s = time.perf_counter() - t
    print(
        f"{N} nodes; genlm_fast tries built in {build_s:.2f} s; reference ({ref.source}) in "
        f"{ref_build_s:.2f} s",
        flush=True,
    )

    how = timer_name(device)
    if device.type == "cuda":
        dev_name = torch.cuda.get_device_name(device)
    else:
        dev_name = f"CPU ({machine.cpu_model()}, {os.cpu_count()} cores) -- dry run"
    peak = detect_peak(dev_name, args.peak_gbs)
    rows, failures = [], []
    breakdown_b = GOAL_PEAK_B if GOAL_PEAK_B in args.batch_sizes else max(args.batch_sizes)
    for B in args.batch_sizes:
        logits, probs = make_inputs(len(vocab), B)
        logits, probs = logits.to(device), probs.to(device)
        ref_ms = {
            "sum": bench_ms(lambda p=probs: ref.device_sum(p), device, how),
            "max": bench_ms(lambda p=probs: ref.device_max(p), device, how),
            "log_mass": bench_ms(lambda z=logits: ref.device_log_mass(z), device, how),
        }
        ref_api_ms = (
            bench_ms(lambda p=probs: ref.api_sum(p), device, how) if B == SPEEDUP_B else None
        )
        for op in args.ops:
            x = logits if op == "log_mass" else probs
            want = ref.oracle(op, logits, probs)
            in_byte_trie = ref.char_trie_columns  # the oracle lacks our EOS column
            traffic_in, traffic_out = io_bytes(x, op, N)
            for b in backends:
                trie = tries[b]
                api = getattr(trie, OP_METHOD[op])
                kfn = kernel_call(b, x.contiguous(), layout, op)
                try:  # verify first; a wrong or failing backend is reported, never timed
                    got = api(x)
                    assert trie.last_kernel_backend == b, (trie.last_kernel_backend, b)
                    err = check_result(
                        got, want, op, byte_trie=in_byte_trie, label=f"{b} {op} B={B}"
                    )
                    err = max(
                        err,
                        check_result(
                            kfn(), want, op, byte_trie=in_byte_trie, label=f"{b} kernels {op} B={B}"
                        ),
                    )
                    del got
                    host_fn = None
                    if op == "sum" and B == SPEEDUP_B:  # genlm's API: numpy on the host
                        host_fn = drop_in[b].batch_weight_sum
                        host = host_fn(x)
                        assert drop_in[b].last_kernel_backend == b
                        assert isinstance(host, np.ndarray), type(host)
                        check_result(
                            host, ref.char_columns(want), op, label=f"{b} drop-in {op} B={B}"
                        )
                        del host
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{b} {op} B={B}: {type(e).__name__}: {e}")
                    print(f"{b:9s} {op:8s} B={B:<4d} FAILED: {failures[-1]}", flush=True)
                    rows.append({"backend": b, "op": op, "B": B, "failed": failures[-1]})
                    continue
                api_ms = bench_ms(lambda f=api, v=x: f(v), device, how)
                kernel_ms = bench_ms(kfn, device, how)
                host_ms = (
                    bench_ms(lambda f=host_fn, v=x: f(v), device, how)
                    if host_fn is not None
                    else None
                )
                idx = index_bytes(layout, b, device=device)
                moved = traffic_in + traffic_out + idx
                gbs = moved / (kernel_ms * 1e-3) / 1e9
                api_gbs = moved / (api_ms * 1e-3) / 1e9
                row = {
                    "backend": b,
                    "op": op,
                    "B": B,
                    "api_ms": api_ms,
                    "kernel_ms": kernel_ms,
                    "read_MB": traffic_in / 1e6,
                    "write_MB": traffic_out / 1e6,
                    "index_MB": idx / 1e6,
                    "moved_MB": moved / 1e6,
                    "GBs": gbs,
                    "peak_frac": gbs / peak if peak else None,
                    "api_GBs": api_gbs,
                    "api_peak_frac": api_gbs / peak if peak else None,
                    "ref_ms": ref_ms[op],
                    "speedup": ref_ms[op] / kernel_ms,
                    "ref_api_ms": ref_api_ms if op == "sum" else None,
                    "host_api_ms": host_ms,
                    "speedup_api": (ref_api_ms / host_ms) if (ref_api_ms and host_ms) else None,
                    "max_rel_err": err,
                }
                if B == breakdown_b:
                    try:  # a profiler problem must not cost the session its timings
                        row["breakdown"] = kernel_breakdown(kfn, device)
                    except Exception as e:  # noqa: BLE001
                        print(
                            f"{b} {op} B={B}: no kernel breakdown: {type(e).__name__}: {e}",
                            flush=True,
                        )
                rows.append(row)
                print(
                    f"{b:9s} {op:8s} B={B:<4d} api {api_ms:9.4f} ms  kernels "
                    f"{kernel_ms:9.4f} ms  {gbs:8.1f} GB/s"
                    + (f" ({100 * gbs / peak:.0f}% of peak)" if peak else "")
                    + f"  ref {ref_ms[op]:.4f} ms -> {row['speedup']:.1f}x",
                    flush=True,
                )
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git commit": machine.git_commit(),
        "device": dev_name,
        "peak HBM bandwidth used": (
            f"{peak:g} GB/s"
            + (" (--peak-gbs)" if args.peak_gbs else " (detected from the device name)")
        )
        if peak
        else "unknown (pass --peak-gbs)",
        "torch": torch.__version__,
        "CUDA (torch build)": torch.version.cuda or "-",
        "triton": machine.dist_version("triton"),
        "python": platform.python_version(),
        "vocabulary": f"{label}: {len(vocab)} tokens, {N} nodes (genlm_fast TokenByteTrie)",
        "backends": ", ".join(backends)
        + (f" (not available: {', '.join(skipped)})" if skipped else ""),
        "timer": {
            "do_bench": "triton.testing.do_bench, median, L2 flushed",
            "cuda_events": "CUDA events, median of 50, L2 flushed",
            "perf_counter": "time.perf_counter, median",
        }[how],
        "reference": ref.source,
        "oracle": "float64, from the reference's ancestor matrix"
        + (
            " (genlm.backend's own: independent of genlm_fast's layout)"
            if ref.trie is not None
            else " (rebuilt from genlm_fast's layout)"
        ),
        "index arrays counted": "; ".join(f"{b}: {' + '.join(index_arrays(b))}" for b in backends),
        "genlm-backend": machine.dist_version("genlm-backend"),
    }
    if failures:
        info["FAILED (not timed)"] = "; ".join(failures)
    context = {
        "vocab": vocab,
        "layout": layout,
        "ref": ref,
        "device": device,
        "how": how,
        "peak": peak,
        "backends": backends,
    }
    return rows, info, context


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu.bench",
        description="Time the fused trie kernels on a GPU "
        "(bytes moved, bandwidth, speedup vs genlm.backend's ParallelTokenCharacterTrie).",
    )
    parser.add_argument(
        "--out", default=None, help="markdown output (default bench/results/gpu-<device>-<date>.md)"
    )
    parser.add_argument("--vocab", default="llama3", help="quicktok encoding (default llama3)")
    parser.add_argument("--vocab-file", default=None, help="a vocabulary written by --dump-vocab")
    parser.add_argument(
        "--dump-vocab",
        metavar="PATH",
        default=None,
        help="write --vocab's tokens to PATH (for machines without quicktok) and exit",
    )
    parser.add_argument("--limit", type=int, default=None, help="use only the first N tokens")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=list(DEFAULT_BATCHES))
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument(
        "--backends",
        nargs="+",
        default=None,
        help="backends to time (default: triton and cuda, those available)",
    )
    parser.add_argument(
        "--peak-gbs",
        type=float,
        default=None,
        help="peak HBM bandwidth in GB/s (default: from the device name)",
    )
    parser.add_argument(
        "--inline-reference",
        action="store_true",
        help="use the inline reference even when genlm.backend imports",
    )
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help=f"run the same code path on CPU (reference/cpu/triton-interpreter "
        f"backends, first {DRY_RUN_TOKENS} tokens, B in {DRY_RUN_BATCHES}) to test this "
        "script",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="then time the Triton tile kernels in every TRITON_SWEEP "
        "configuration (a section of the table)",
    )
    args = parser.parse_args(argv)

    if args.dump_vocab:
        dump_vocab(args.vocab, args.dump_vocab)
        return 0
    if args.dry_run_cpu:
        # the Triton interpreter must be chosen before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if args.batch_sizes == list(DEFAULT_BATCHES):
            args.batch_sizes = list(DRY_RUN_BATCHES)
    rows, info, context = run(args)
    command = "python -m tools.gpu.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out:
        out = Path(args.out)
    else:
        dev = re.sub(r"[^A-Za-z0-9]+", "-", info["device"].split(" --")[0]).strip("-").lower()
        dev = "cpu-dry-run" if args.dry_run_cpu else dev
        out = REPO / "bench" / "results" / f"gpu-{dev}-{datetime.date.today().isoformat()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = table(rows, info, command.strip())
    out.write_text(text)  # before the extras: a session cut short keeps the main table
    try:  # a problem with the floors must not cost the session its sweep
        floor_rows = memory_floors(context)
    except Exception as e:  # noqa: BLE001
        print(f"no memory floors: {type(e).__name__}: {e}", flush=True)
        floor_rows = []
    sweep_rows = triton_sweep(args, context) if args.sweep else []
    text = table(rows, info, command.strip(), sweep_rows, floor_rows)
    out.write_text(text)
    print()
    print(text)
    print(f"wrote {out}")
    if "FAILED (not timed)" in info:
        print("some backends FAILED verification: " + info["FAILED (not timed)"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
