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
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import pickle
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OPS = ("log_mass", "sum", "max")
OP_METHOD = {"sum": "batch_weight_sum", "max": "batch_weight_max", "log_mass": "batch_log_mass"}
GPU_BACKENDS = ("triton", "cuda")
DEFAULT_BATCHES = (1, 8, 32, 64, 128)
SPEEDUP_B = 32
# index arrays each backend's kernels read (ModeLayout names); counted once per call
SPAN_ARRAYS = ("span_node", "span_left", "span_right", "span_tile_lo", "span_tile_hi")
INDEX_ARRAYS = {
    # the same tiles: the Triton kernels read their local ranges, csrc/trie_reduce_cuda.cu
    # the tiles' sources (runs, each owned node's source, the scratch values'; from 8 rows
    # on, staged, column_leaf of the same size instead of leaf_token)
    "triton": (
        "leaf_token",
        "tile_range_ptr",
        "tile_unit_end",
        "range_start",
        "range_end",
        "range_dest",
    )
    + SPAN_ARRAYS,
    "cuda": (
        "leaf_token",
        "tile_node_lo",
        "tile_run_ptr",
        "run_bounds",
        "node_src",
        "tile_scratch_ptr",
        "scratch_src",
        "scratch_slot",
    )
    + SPAN_ARRAYS,
    # the CPU kernel's (genlm_fast/ops/cpu_backend.py): the layout's parent and leaf_token,
    # and the arrays it derives once per layout (cpu_backend.cpu_arrays)
    "cpu": (
        "parent",
        "leaf_token",
        "node_of_leaf",
        "empty",
        "run_end",
        "run_depth",
        "run_child_slot",
        "run_join_slot",
        "run_leaf",
        "run_of",
    ),
}
# peak HBM bandwidth, GB/s (vendor figures), matched against the device name in order
# (GH200 before H200, which its name contains: GH200 96 GB HBM3 is 4000 GB/s, the 144 GB
# HBM3e part 4900; --peak-gbs overrides)
PEAKS = (
    (r"GH200.*(144|HBM3e)", 4900.0),
    (r"GH200", 4000.0),
    (r"H200", 4800.0),
    (r"H100.*(PCIe|PCI-E)", 2000.0),
    (r"H100.*NVL", 3900.0),
    (r"H100", 3350.0),
    (r"A100.*80", 2039.0),
    (r"A100", 1555.0),
    (r"L40S", 864.0),
    (r"A10G?\b", 600.0),
    (r"L4\b", 300.0),
)
# the project's GPU goals (Llama-3): kernels' share of peak HBM bandwidth for batch_log_mass at
# B=64, and the speedup over the reference's batch_weight_sum device time at B=32
GOAL_PEAK_OP, GOAL_PEAK_B, GOAL_PEAK_FRAC = "log_mass", 64, 0.70
GOAL_SPEEDUP = 10.0
DRY_RUN_TOKENS = 500
DRY_RUN_BATCHES = [1, 32]
# --sweep: Triton tile-kernel configurations to time, per tile kernel (module constants of
# genlm_fast.ops.triton_backend, set for one measurement each). The defaults there are the
# fastest of a sweep (bench/results/README.md names the run); these are their neighbours.
# ROWS >= 16 for tl.dot.
TRITON_SWEEP = {
    "dot": [
        {"DOT_ROWS": rows, "DOT_WARPS": warps}
        for rows, warps in ((16, 2), (16, 4), (16, 8), (32, 4))
    ]
    + [
        {"DOT_ROWS": 16, "DOT_WARPS": 4, "DOT_UB": 32, "DOT_RB": 32},
        {"DOT_ROWS": 16, "DOT_WARPS": 4, "DOT_UB": 128, "DOT_RB": 128},
    ],
    "max": [
        {"MAX_ROWS": rows, "MAX_WARPS": warps, "MAX_RB": rb}
        for rows, warps, rb in ((4, 4, 32), (8, 2, 32), (8, 4, 32), (8, 4, 64), (16, 4, 32))
    ],
}


# --------------------------------------------------------------------------- vocabulary


def _quicktok_pairs(name: str):
    import quicktok

    enc = quicktok.get_encoding(name)
    pairs = []
    for i in range(enc.n_vocab):
        try:
            bs = enc.decode_single_token_bytes(i)
        except (KeyError, ValueError):
            bs = f"<|unassigned_{i}|>".encode()
        pairs.append((i, bs))
    return pairs


def dump_vocab(name: str, path: str) -> None:
    """Pickle ``[(token_id, bytes), ...]`` (plain tuples: no package needed to read it)."""
    pairs = _quicktok_pairs(name)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({"name": name, "tokens": pairs}, f, protocol=4)
    print(f"wrote {len(pairs)} tokens of {name} to {path}")


def _synthetic_pairs(n: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    seen, pairs = set(), []
    for b in range(256):
        seen.add(bytes([b]))
        pairs.append((b, bytes([b])))
    while len(pairs) < n:
        bs = bytes(rng.choice(b"etaoinshrdlu _") for _ in range(rng.randint(2, 8)))
        if bs not in seen:
            seen.add(bs)
            pairs.append((len(pairs), bs))
    return pairs


def load_vocab(name: str, vocab_file: str | None, limit: int | None = None):
    """``(label, [genlm_fast Token])`` from a ``--dump-vocab`` file or quicktok (or, for the
    dry run only, synthetic)."""
    from genlm_fast.backend.tokenization import Token

    if vocab_file:
        with open(vocab_file, "rb") as f:
            data = pickle.load(f)
        label, pairs = data["name"], data["tokens"]
    else:
        try:
            pairs = _quicktok_pairs(name)
            label = name
        except Exception as e:
            if limit is None:
                raise SystemExit(
                    f"cannot load vocabulary {name!r} ({type(e).__name__}: {e}); "
                    "create a file elsewhere with `python -m tools.gpu.bench --dump-vocab "
                    "PATH` and pass --vocab-file PATH"
                ) from e
            pairs, label = _synthetic_pairs(limit), "synthetic"
    if limit is not None and len(pairs) > limit:
        pairs, label = pairs[:limit], f"{label}[:{limit}]"
    return label, [Token(int(i), bytes(b)) for i, b in pairs]


# --------------------------------------------------------------------------- timing


def _sync(device):
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def bench_ms(fn, device, how: str) -> float:
    """Median ms per call of ``fn()``: do_bench / CUDA events on a GPU, perf_counter on CPU."""
    import torch

    if device.type != "cuda":  # the dry run: correctness of this script, not timing
        times = []
        deadline = time.perf_counter() + 0.2
        while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    if how == "do_bench":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    # CUDA events, with an L2 flush before each call as do_bench does
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)
    for _ in range(5):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(50):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timer_name(device) -> str:
    if device.type != "cuda":
        return "perf_counter"
    try:
        from triton.testing import do_bench  # noqa: F401

        return "do_bench"
    except ImportError:
        return "cuda_events"


def kernel_breakdown(fn, device, calls: int = 20) -> list[tuple[str, float]]:
    """(kernel, ms per call) of the device work ``fn`` does, by torch.profiler, slowest
    first: which kernel of a backend's chain the time goes to. Calls run back to back (L2
    not flushed). On CPU (the dry run) the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    found = []
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            found.append((kernel_name(event.key), us / calls / 1e3))
    return sorted(found, key=lambda item: -item[1])


def kernel_name(key: str) -> str:
    """A profiler key, shortened for the table: a C++ kernel's signature (it has a parameter
    list) loses its return type, namespaces (anonymous ones included) and parameters,
    keeping its name and template arguments; other keys (Triton kernels, aten ops) stay."""
    if "(" not in key:
        return key[:70]
    name = key.replace("(anonymous namespace)::", "")
    name = name.split("(", 1)[0].removeprefix("void ")
    return re.sub(r"^(\w+::)+", "", name)[:70]


# --------------------------------------------------------------------------- reference


class Reference:
    """genlm's ParallelTokenCharacterTrie algorithm, on the device: the package's own object
    when ``genlm.backend`` imports (and ``inline`` is False), else rebuilt from the layout."""

    def __init__(self, vocab, layout, device, inline: bool = False):
        self.device = device
        self.source = None
        why = "--inline-reference"
        if not inline:
            try:
                from genlm.backend.tokenization import Token as RefToken
                from genlm.backend.trie import ParallelTokenCharacterTrie

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    trie = ParallelTokenCharacterTrie(
                        [RefToken(t.token_id, t.byte_string) for t in vocab], device=device.type
                    )
                import numpy as np

                # node-wise comparisons need genlm's numbering: genlm_fast's TokenByteTrie is
                # genlm's character trie plus an EOS node numbered just before the root
                if len(trie.children) != layout.num_nodes - 1 or not np.array_equal(
                    np.asarray(trie.idx_to_leaf)[:, 1], np.asarray(layout.leaf_node)
                ):
                    raise ValueError(
                        "it numbers the trie's nodes differently from genlm_fast "
                        "(a genlm_fast bug: tests/ should have caught it)"
                    )
                self.trie, self.M, self.positions = trie, trie.M, trie.positions
                self.src, self.dst = trie.src_indices, trie.dst_indices
                self.source = "genlm.backend ParallelTokenCharacterTrie (installed package)"
            except Exception as e:  # noqa: BLE001 -- not installed, or unusable here
                why = f"genlm.backend not usable: {type(e).__name__}: {e}"
        if self.source is None:
            self.trie = None
            self.M, self.positions, self.src, self.dst = self._ancestor_matrix(layout, device)
            self.source = (
                "inline re-implementation of genlm.backend's ParallelTokenCharacterTrie "
                f"algorithm ({why})"
            )
        self.num_nodes = self.M.shape[1]
        # the oracle's columns: genlm's character trie has no EOS node; genlm_fast's
        # TokenByteTrie numbers one just before the root (empty in without_eos mode)
        self.char_trie_columns = self.num_nodes == layout.num_nodes - 1
        self._M64 = None
        _sync(device)

    @staticmethod
    def _ancestor_matrix(layout, device):
        """CSR [V, N]: row i has a 1 at the leaf of vocabulary position i and every ancestor."""
        import numpy as np
        import torch

        parent = np.asarray(layout.parent, dtype=np.int64)
        cur = np.asarray(layout.leaf_node, dtype=np.int64)
        rows_all, cols_all = [], []
        idx = np.arange(len(cur))
        while len(idx):
            rows_all.append(idx)
            cols_all.append(cur)
            up = parent[cur]
            keep = up >= 0
            idx, cur = idx[keep], up[keep]
        rows = torch.from_numpy(np.concatenate(rows_all))
        cols = torch.from_numpy(np.concatenate(cols_all))
        indices = torch.stack([rows, cols]).to(device)
        values = torch.ones(indices.shape[1], device=device)
        M = torch.sparse_coo_tensor(indices, values, (len(layout.leaf_node), layout.num_nodes))
        M = M.coalesce().to_sparse_csr()
        positions = torch.arange(len(layout.leaf_node), device=device)
        return M, positions, indices[0].contiguous(), indices[1].contiguous()

    def device_sum(self, ws):
        """The reference's device work for batch_weight_sum (no host copy)."""
        import torch

        return torch.sparse.mm(ws[:, self.positions], self.M)

    def device_max(self, ws):
        """The reference's device work for batch_weight_max (scatter_reduce amax)."""
        import torch

        leaf = ws[:, self.positions]
        out = torch.zeros(ws.shape[0], self.num_nodes, device=ws.device, dtype=ws.dtype)
        return out.scatter_reduce_(
            1,
            self.dst.expand(ws.shape[0], -1),
            leaf[:, self.src],
            reduce="amax",
            include_self=False,
        )

    def device_log_mass(self, logits):
        """log_softmax, exp, the sparse product, log: the reference's log-mass, on the device."""
        import torch

        return torch.log(self.device_sum(torch.log_softmax(logits, dim=-1).exp()))

    def oracle(self, op, logits, probs):
        """Float64 node values ``[B, N_ref]`` (numpy) from the reference's own ancestor matrix:
        sums as a float64 sparse product, max as a float64 scatter amax, log-masses as the log
        of the float64 sum of float64 softmax probabilities. With genlm.backend installed this
        owes nothing to genlm_fast's layout."""
        import numpy as np
        import torch

        if self._M64 is None:
            self._M64 = self.M.to(torch.float64)
        if op == "max":
            ws = probs.double()
            leaf = ws[:, self.positions]
            out = torch.zeros(ws.shape[0], self.num_nodes, device=ws.device, dtype=torch.float64)
            out.scatter_reduce_(
                1,
                self.dst.expand(ws.shape[0], -1),
                leaf[:, self.src],
                reduce="amax",
                include_self=False,
            )
            return out.cpu().numpy()
        ws = torch.softmax(logits.double(), dim=-1) if op == "log_mass" else probs.double()
        out = torch.sparse.mm(ws[:, self.positions], self._M64).cpu().numpy()
        if op == "log_mass":
            with np.errstate(divide="ignore"):
                return np.log(out)
        return out

    def char_columns(self, want):
        """``want`` without genlm_fast's EOS column, to compare with a character trie."""
        import numpy as np

        if self.char_trie_columns:
            return want
        n = want.shape[1]
        return np.concatenate([want[:, : n - 2], want[:, n - 1 :]], axis=1)

    def api_sum(self, ws):
        """The full reference call (row loop, device work, copy to host) when available."""
        return (
            self.trie.batch_weight_sum(ws)
            if self.trie is not None
            else self.device_sum(ws).cpu().numpy()
        )


# --------------------------------------------------------------------------- the run


def detect_peak(name: str, override: float | None) -> float | None:
    if override:
        return float(override)
    for pattern, gbs in PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return gbs
    return None


def index_bytes(layout, backend: str, mode: str = "without_eos", device=None) -> int:
    """Bytes of the index arrays ``backend``'s kernels read (``INDEX_ARRAYS``). A name found
    nowhere is an error: a silent 0 would inflate the bandwidth."""
    ml = layout.modes[mode]
    names = INDEX_ARRAYS.get(backend, INDEX_ARRAYS["triton"])
    derived = {}
    if backend == "cpu":  # derived from the layout on the first call, kept with its arrays
        from genlm_fast.ops import cpu_backend

        derived = cpu_backend.cpu_arrays(layout.device_arrays(mode, device or "cpu", "cpu"))
    total = 0
    for n in names:
        arr = getattr(ml, n, None)
        if arr is None:
            arr = getattr(layout, n, None)
        if arr is None:
            arr = derived.get(n)
        if arr is None:
            raise KeyError(f"index array {n!r} of the {backend} backend not found in the layout")
        total += int(arr.nbytes) if hasattr(arr, "nbytes") else arr.numel() * arr.element_size()
    return total


def io_bytes(x, op: str, num_nodes: int) -> tuple[int, int]:
    """The compulsory traffic of one call on ``x`` [B, V']: (bytes read: the input once,
    bytes written: the [B, N] result once)."""
    import torch

    from genlm_fast.ops import dispatch

    out_dtype = dispatch.result_dtype(op, x.dtype)  # float32 for float32 inputs
    return (
        x.shape[0] * x.shape[1] * x.element_size(),
        x.shape[0] * num_nodes * torch.empty((), dtype=out_dtype).element_size(),
    )


def kernel_call(backend, values, layout, reduction, mode="without_eos"):
    """The backend alone (``dispatch.run_backend``: no validation, no row check; the CUDA
    row verdict comes out of its row pass, unread here); returns the result."""
    from genlm_fast.ops import dispatch

    layout.device_arrays(mode, values.device, backend)  # built outside the timed calls

    def fn():
        return dispatch.run_backend(values, layout, reduction, mode, backend)[0]

    return fn


def _kernels_alias() -> None:
    """In an uninstalled checkout ``genlm_fast.kernels`` is the top-level ``kernels/``
    (setup.py maps it at install time); alias it so the triton backend imports."""
    import importlib

    try:
        importlib.import_module("genlm_fast.kernels")
    except ImportError:
        try:
            sys.modules["genlm_fast.kernels"] = importlib.import_module("kernels")
        except ImportError:
            pass


def run(args) -> tuple[list[dict], dict]:
    import numpy as np
    import torch

    _kernels_alias()

    from bench import kernels as K
    from bench import machine
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
        logits, probs = K.make_inputs(len(vocab), B)
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
                    err = K.check_result(
                        got, want, op, byte_trie=in_byte_trie, label=f"{b} {op} B={B}"
                    )
                    err = max(
                        err,
                        K.check_result(
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
                        K.check_result(
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
        "index arrays counted": "; ".join(
            f"{b}: {' + '.join(INDEX_ARRAYS.get(b, INDEX_ARRAYS['triton']))}"
            + ("" if b in INDEX_ARRAYS else " (assumed: same as triton)")
            for b in backends
        ),
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


@contextlib.contextmanager
def triton_config(**constants):
    """The Triton backend's launch constants (``DOT_ROWS=32``, ...) set for the block."""
    from genlm_fast.ops import triton_backend as tb

    saved = {name: getattr(tb, name) for name in constants}  # AttributeError for a typo
    try:
        for name, value in constants.items():
            setattr(tb, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(tb, name, value)


def triton_sweep(args, context) -> list[dict]:
    """Kernel time of every TRITON_SWEEP configuration of the tile kernel each op runs, at
    the goals' batch sizes (sum: SPEEDUP_B; log_mass, max: GOAL_PEAK_B), where in
    --batch-sizes (else the largest). Each is checked against the oracle before it is timed."""
    from bench import kernels as K
    from genlm_fast.ops import triton_backend as tb

    if "triton" not in context["backends"]:
        print("--sweep: the triton backend is not available; nothing to sweep", flush=True)
        return []
    layout, ref, device = context["layout"], context["ref"], context["device"]
    how, peak = context["how"], context["peak"]
    out = []
    for op in args.ops:
        B = {"sum": SPEEDUP_B}.get(op, GOAL_PEAK_B)
        B = B if B in args.batch_sizes else max(args.batch_sizes)
        logits, probs = K.make_inputs(len(context["vocab"]), B)
        logits, probs = logits.to(device), probs.to(device)  # where the reference's arrays are
        want = ref.oracle(op, logits, probs)
        x = (logits if op == "log_mass" else probs).contiguous()
        kind = tb.tile_kernel(op, x.dtype)
        moved = sum(io_bytes(x, op, layout.num_nodes)) + index_bytes(
            layout, "triton", device=device
        )
        for config in TRITON_SWEEP.get(kind, []):
            label = ", ".join(f"{k}={v}" for k, v in config.items())
            default = all(getattr(tb, k) == v for k, v in config.items())
            row = {"op": op, "B": B, "kernel": kind, "config": label, "default": default}
            with triton_config(**config):
                kfn = kernel_call("triton", x, layout, op)
                try:  # a configuration that fails to compile or to verify is reported
                    row["max_rel_err"] = K.check_result(
                        kfn(),
                        want,
                        op,
                        byte_trie=ref.char_trie_columns,
                        label=f"triton {op} B={B} {label}",
                    )
                    row["kernel_ms"] = bench_ms(kfn, device, how)
                except Exception as e:  # noqa: BLE001
                    row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
            if "kernel_ms" in row:
                row["GBs"] = moved / (row["kernel_ms"] * 1e-3) / 1e9
                row["peak_frac"] = row["GBs"] / peak if peak else None
                print(
                    f"sweep triton {op:8s} B={B:<4d} {label:45s} {row['kernel_ms']:9.4f} ms "
                    f"{row['GBs']:8.1f} GB/s" + (" (default)" if default else ""),
                    flush=True,
                )
            else:
                print(
                    f"sweep triton {op:8s} B={B:<4d} {label:45s} FAILED: {row['failed']}",
                    flush=True,
                )
            out.append(row)
    return out


def _bench_input(context, op: str, B: int):
    """The benchmark's [B, V] input for ``op`` (logits for log_mass, else probabilities)."""
    from bench import kernels as K

    logits, probs = K.make_inputs(len(context["vocab"]), B)
    return (logits if op == "log_mass" else probs).to(context["device"]).contiguous()


def memory_floors(context) -> list[dict]:
    """What the memory system alone gives at the goals' shapes (log_mass at GOAL_PEAK_B, sum
    at SPEEDUP_B), with torch's own kernels and the same timer: the [B, N] float32 output
    written once (``fill_``), the [B, V'] input read once (``amax`` over each row), read and
    written once (``copy_``: what staging the rows costs at the least), and gathered into
    [B, N] (``index_select`` of each node's last leaf's column: the fused pass with no
    reduction and no normalization at all). They say what fraction of peak a kernel that only
    moves the goal's traffic gets on this device, to read the trie kernels' fraction against
    (torch's kernels are good streaming kernels, not proven optimal ones). The tile pattern's
    floors (``_tile_pattern_cases``) say how much of the gap is the pattern's own."""
    import torch

    layout, device = context["layout"], context["device"]
    how, peak = context["how"], context["peak"]
    ml = layout.modes["without_eos"]
    leaf_end = torch.as_tensor(ml.leaf_end, dtype=torch.int64)
    has_leaf = leaf_end > torch.as_tensor(ml.leaf_start, dtype=torch.int64)
    last_column = torch.as_tensor(ml.leaf_token, dtype=torch.int64)[(leaf_end - 1).clamp(min=0)]
    node_column = torch.where(has_leaf, last_column, 0).to(device)
    N, L = layout.num_nodes, len(ml.leaf_token)
    tile_node_lo = torch.as_tensor(ml.tile_node_lo).to(device)
    out = []
    for op, B in ((GOAL_PEAK_OP, GOAL_PEAK_B), ("sum", SPEEDUP_B)):
        x = _bench_input(context, op, B)
        result = torch.empty(B, N, dtype=torch.float32, device=device)
        copy = torch.empty_like(x)
        in_bytes, out_bytes = x.numel() * x.element_size(), result.numel() * 4
        cases = [
            # (each timed in this round of the loop: its tensors bound now)
            ("write [B, N] once (fill_)", out_bytes, lambda result=result: result.fill_(1.0)),
            ("read [B, V'] once (amax per row)", in_bytes, lambda x=x: torch.amax(x, dim=1)),
            ("read and write [B, V'] (copy_)", 2 * in_bytes, lambda x=x, copy=copy: copy.copy_(x)),
            (
                "gather [B, V'] into [B, N] (index_select)",
                in_bytes + out_bytes,
                lambda x=x, result=result: torch.index_select(x, 1, node_column, out=result),
            ),
        ]
        try:  # a Triton problem here must not cost the session torch's floors
            cases += _tile_pattern_cases(result, tile_node_lo, ml.tile, L, out_bytes)
        except Exception as e:  # noqa: BLE001
            print(f"no tile-pattern floors: {type(e).__name__}: {e}", flush=True)
        for name, moved, fn in cases:
            ms = bench_ms(fn, device, how)
            gbs = moved / (ms * 1e-3) / 1e9
            out.append(
                {
                    "op": op,
                    "B": B,
                    "floor": name,
                    "MB": moved / 1e6,
                    "ms": ms,
                    "GBs": gbs,
                    "peak_frac": gbs / peak if peak else None,
                }
            )
            print(f"floor {op:8s} B={B:<4d} {name:45s} {ms:9.4f} ms {gbs:8.1f} GB/s", flush=True)
    return out


def _tile_pattern_cases(result, tile_node_lo, tile: int, L: int, out_bytes: int) -> list:
    """The floors in the CUDA tile kernel's own pattern (tools/gpu/tile_floors.py), each checked
    once against plain torch first."""
    import torch

    from tools.gpu import tile_floors

    B, N = result.shape
    staged = torch.rand(B * L, generator=torch.Generator().manual_seed(0)).to(result.device)
    cases = []
    for name, moved, kwargs in (
        ("write [B, N] as the tile blocks do (32 rows x a tile's ids)", out_bytes, {}),
        ("write [B, N] as blocks of 4 tiles would", out_bytes, {"tiles": 4}),
        (
            "read the staged [B, L], write [B, N], as the tile blocks do",
            staged.numel() * 4 + out_bytes,
            {"staged": staged},
        ),
    ):
        result.fill_(float("nan"))
        tile_floors.tile_pattern(result, tile_node_lo, tile, L, **kwargs)
        want = tile_floors.expected(B, N, tile_node_lo, tile, L, kwargs.get("staged"))
        torch.testing.assert_close(result.cpu(), want, rtol=1e-4, atol=0.0, msg=name)
        cases.append(
            (
                name,
                moved,
                lambda kw=kwargs: tile_floors.tile_pattern(result, tile_node_lo, tile, L, **kw),
            )
        )
    return cases


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def table(rows, info, command: str, sweep_rows=(), floor_rows=()) -> str:
    lines = ["# genlm_fast GPU trie kernels", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += [
        "",
        f"Command: `{command}`",
        "",
        (
            "api ms: the public call (`TokenByteTrie.batch_log_mass` / `batch_weight_sum` / "
            "`batch_weight_max`, validation included, result on the device); kernel ms: the "
            "backend's kernels alone. Traffic: input read once (B x V' x 4 B), output written "
            "once (B x N x 4 B), index arrays read once; GB/s = traffic / kernel ms (api GB/s: "
            "/ api ms). ref ms: the "
            "reference's device work (sum: `sparse.mm(ws[:, positions], M)`; max: its "
            "`scatter_reduce` amax; log_mass: log_softmax, exp, sparse.mm, log); speedup = "
            "ref ms / kernel ms. Every result was checked against the float64 oracle first "
            "(max rel err = worst relative error of a node mass >= 1e-30)."
        ),
        "",
        (
            "| backend | op | B | api ms | kernel ms | MB read | MB written | MB index | GB/s "
            "| % of peak | api GB/s | api % of peak | ref ms | speedup | max rel err |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(
                f"| {r['backend']} | {r['op']} | {r['B']} | FAILED verification: "
                f"{r['failed']} |" + " |" * 11
            )
            continue
        frac = "-" if r["peak_frac"] is None else f"{100 * r['peak_frac']:.0f}%"
        api_frac = "-" if r.get("api_peak_frac") is None else f"{100 * r['api_peak_frac']:.0f}%"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        lines.append(
            f"| {r['backend']} | {r['op']} | {r['B']} | {r['api_ms']:.4f} | "
            f"{_f(r['kernel_ms'], '.4f')} | {r['read_MB']:.2f} | {r['write_MB']:.2f} | "
            f"{r['index_MB']:.2f} | {r['GBs']:.0f} | {frac} | {_f(r.get('api_GBs'), '.0f')} | "
            f"{api_frac} | {_f(r['ref_ms'], '.4f')} | {speedup} | {r['max_rel_err']:.1e} |"
        )
    lines += [
        "",
        f"Speedup at B={SPEEDUP_B} vs the reference's batch_weight_sum:",
        "",
        (
            "| backend | kernels vs ref device time | full call vs full call (both return "
            "numpy on the host: genlm's and genlm_fast's `ParallelTokenCharacterTrie`) |"
        ),
        "|---|---:|---:|",
    ]
    for r in rows:
        if r["op"] == "sum" and r["B"] == SPEEDUP_B and "failed" not in r:
            lines.append(
                f"| {r['backend']} | {_f(r['speedup'], '.1f')}x ({_f(r['ref_ms'], '.3f')} ms vs "
                f"{_f(r['kernel_ms'], '.3f')} ms) | {_f(r['speedup_api'], '.1f')}x "
                f"({_f(r['ref_api_ms'], '.3f')} ms vs {_f(r.get('host_api_ms'), '.3f')} ms) |"
            )
    broken_down = [r for r in rows if r.get("breakdown")]
    if broken_down:
        lines += [
            "",
            f"Where the kernel time goes at B={broken_down[0]['B']} (torch.profiler, "
            "20 calls back to back; ms per call):",
            "",
            "| backend | op | kernel | ms |",
            "|---|---|---|---:|",
        ]
        for r in broken_down:
            for name, ms in r["breakdown"][:6]:
                lines.append(f"| {r['backend']} | {r['op']} | `{name}` | {ms:.4f} |")
    lines += [
        "",
        "Goals (Llama-3 vocabulary):",
        "",
        "| goal | backend | measured | met |",
        "|---|---|---:|---|",
    ]
    for r in goals(rows):
        lines.append(f"| {r['goal']} | {r['backend']} | {r['measured']} | {r['met']} |")
    if floor_rows:
        lines += [
            "",
            "Memory floors at the goals' shapes (torch's own kernels, then Triton "
            "kernels moving the same bytes in the CUDA tile kernel's pattern with no "
            "reduction, tools/gpu/tile_floors.py; same timer; `memory_floors`): what the "
            "memory system gives a kernel of that traffic:",
            "",
            "| op | B | floor | MB moved | ms | GB/s | % of peak |",
            "|---|---:|---|---:|---:|---:|---:|",
        ]
        for r in floor_rows:
            frac = "-" if r["peak_frac"] is None else f"{100 * r['peak_frac']:.0f}%"
            lines.append(
                f"| {r['op']} | {r['B']} | {r['floor']} | {r['MB']:.2f} | "
                f"{r['ms']:.4f} | {r['GBs']:.0f} | {frac} |"
            )
    if sweep_rows:
        lines += [
            "",
            "Triton tile-kernel configurations (`--sweep`; constants of "
            "`genlm_fast.ops.triton_backend`; kernels alone, each checked against the "
            "oracle first; fastest per op in bold):",
            "",
            "| op | B | tile kernel | configuration | kernel ms | GB/s | % of peak | max rel err |",
            "|---|---:|---|---|---:|---:|---:|---:|",
        ]
        timed = [r for r in sweep_rows if "kernel_ms" in r]
        best = {
            op: min(r["kernel_ms"] for r in timed if r["op"] == op)
            for op in {r["op"] for r in timed}
        }
        for r in sweep_rows:
            config = r["config"] + (" (default)" if r["default"] else "")
            if "failed" in r:
                lines.append(
                    f"| {r['op']} | {r['B']} | {r['kernel']} | {config} | FAILED: "
                    f"{r['failed']} | | | |"
                )
                continue
            ms = f"{r['kernel_ms']:.4f}"
            ms = f"**{ms}**" if r["kernel_ms"] == best[r["op"]] else ms
            frac = "-" if r["peak_frac"] is None else f"{100 * r['peak_frac']:.0f}%"
            lines.append(
                f"| {r['op']} | {r['B']} | {r['kernel']} | {config} | {ms} | "
                f"{r['GBs']:.0f} | {frac} | {r['max_rel_err']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def goals(rows) -> list[dict]:
    """The two GPU goals for every backend: kernels at >= 70% of peak HBM bandwidth
    for batch_log_mass at B=64, and >= 10x the reference's batch_weight_sum device time at
    B=32 ("-": not measured, or no peak known)."""
    out = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend and "failed" not in r]
        peak_rows = [r for r in mine if r["op"] == GOAL_PEAK_OP and r["B"] == GOAL_PEAK_B]
        frac = peak_rows[0]["peak_frac"] if peak_rows else None
        out.append(
            {
                "goal": f"batch_{GOAL_PEAK_OP} B={GOAL_PEAK_B}: kernels >= "
                f"{100 * GOAL_PEAK_FRAC:.0f}% of peak HBM bandwidth",
                "backend": backend,
                "measured": "-" if frac is None else f"{100 * frac:.0f}%",
                "met": "-" if frac is None else ("yes" if frac >= GOAL_PEAK_FRAC else "NO"),
            }
        )
        sum_rows = [r for r in mine if r["op"] == "sum" and r["B"] == SPEEDUP_B]
        sp = sum_rows[0]["speedup"] if sum_rows else None
        out.append(
            {
                "goal": f"batch_weight_sum B={SPEEDUP_B}: >= {GOAL_SPEEDUP:g}x the "
                "reference's device time",
                "backend": backend,
                "measured": "-" if sp is None else f"{sp:.1f}x",
                "met": "-" if sp is None else ("yes" if sp >= GOAL_SPEEDUP else "NO"),
            }
        )
    return out


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
