"""How the GPU benchmark measures a call: its time (``bench_ms``, by the timer
``timer_name`` names), where that time goes (``kernel_breakdown``), the compulsory bytes it
moves (``io_bytes``, ``index_bytes``) and the device's peak bandwidth to read them against
(``detect_peak``). ``kernel_call`` is the call of a backend's kernels alone."""

from __future__ import annotations

import re
import statistics
import time

# the index arrays the CPU kernel reads (genlm_fast/ops/cpu_backend.py): the layout's parent
# and leaf_token, and the arrays it derives from them once per layout (cpu_arrays)
CPU_ARRAYS = (
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
)
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


def sync(device):
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


def kernel_call(backend, values, layout, reduction, mode="without_eos"):
    """The backend alone (``dispatch.run_backend``: no validation, no row check; the CUDA
    row verdict comes out of its row pass, unread here); returns the result."""
    from genlm_fast.ops import dispatch

    layout.device_arrays(mode, values.device, backend)  # built outside the timed calls

    def fn():
        return dispatch.run_backend(values, layout, reduction, mode, backend)[0]

    return fn


def kernel_breakdown(fn, device, calls: int = 20) -> list[tuple[str, float]]:
    """(kernel, ms per call) of the device work ``fn`` does, by torch.profiler, slowest
    first: which kernel of a backend's chain the time goes to. Calls run back to back (L2
    not flushed). On CPU (the dry run) the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
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


def detect_peak(name: str, override: float | None) -> float | None:
    if override:
        return float(override)
    for pattern, gbs in PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return gbs
    return None


def index_arrays(backend: str) -> tuple[str, ...]:
    """The index arrays ``backend``'s kernels read, each counted once a call: the CPU
    kernel's ``CPU_ARRAYS``, for the other backends the arrays the layout hands them
    (``genlm_fast.ops.layout.BACKEND_ARRAYS``)."""
    if backend == "cpu":
        return CPU_ARRAYS
    from genlm_fast.ops.layout import BACKEND_ARRAYS

    return BACKEND_ARRAYS[backend]


def index_bytes(layout, backend: str, mode: str = "without_eos", device=None) -> int:
    """Bytes of the index arrays ``backend``'s kernels read (``index_arrays``). A name found
    nowhere is an error: a silent 0 would inflate the bandwidth."""
    ml = layout.modes[mode]
    names = index_arrays(backend)
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
