"""Loader of the compiled trie kernels (``csrc/``): the ``cpu`` and ``cuda`` backends.

``genlm_fast._C`` is built by ``pip install -e .`` (a ``CppExtension``, or a
``CUDAExtension`` when torch has CUDA and nvcc is found). When it was not built, the CPU
kernels are JIT-compiled on first use with ``torch.utils.cpp_extension.load`` into
``~/.cache/genlm_fast/ext`` (``$GENLM_FAST_CACHE/ext`` when set; ``GENLM_FAST_NO_JIT=1``
disables this). A failure is remembered and reported by :func:`why_missing`; the
dispatcher then falls back to another backend. Importing this module never raises.

Backend contract (see ``genlm_fast.ops.dispatch``)::

    trie_reduce(values, arrays, reduction, *, num_nodes, num_scratch, max_span_tiles, tile)
        -> Tensor[B, num_nodes]
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import genlm_fast

logger = logging.getLogger("genlm_fast.ops")

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "csrc")
_CPU_SOURCES = ("bindings.cpp", "trie_reduce_cpu.cpp")
_CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]

# torch's build lock (``lock`` in the build directory) has no timeout: one left by a build
# that was killed would block every later build forever. A build takes about a minute; a
# lock older than this is taken to be such a leftover and removed.
STALE_LOCK_S = 300.0

_lock = threading.Lock()
_module = None  # the loaded extension module
_origin = None  # "prebuilt" or the JIT build directory
_error = None  # why loading failed (a string), once tried
_tried = False


def cache_dir() -> str:
    """Where JIT builds go: ``<genlm_fast cache root>/ext`` (`genlm_fast.cache_dir`)."""
    return genlm_fast.cache_dir("ext")


def clear_stale_lock(build_dir: str) -> None:
    """Wait while another process builds into ``build_dir`` (its lock file exists), but
    remove a lock older than `STALE_LOCK_S`: an interrupted build left it."""
    lock = os.path.join(build_dir, "lock")
    told = False
    while True:
        try:
            age = time.time() - os.path.getmtime(lock)
        except OSError:
            return  # no lock (any more)
        if age >= STALE_LOCK_S:
            logger.warning("genlm_fast: removing the build lock %s, %.0f s old, left by an "
                           "interrupted build", lock, age)
            try:
                os.remove(lock)
            except OSError:
                pass
            return
        if not told:
            told = True
            logger.warning("genlm_fast: waiting for another build of the CPU kernels (%s; "
                           "delete it if no build is running)", lock)
        time.sleep(min(1.0, STALE_LOCK_S - age + 0.01))


def _jit_build(defines=()):
    """Compile the CPU kernels into the cache; ``defines`` (macro names) give a variant its
    own module name and directory (tests build -DGF_BASELINE_ONLY this way)."""
    import torch
    from torch.utils.cpp_extension import load

    sources = [os.path.join(_CSRC, name) for name in _CPU_SOURCES]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise RuntimeError(f"the C++ sources are not available for a JIT build ({missing[0]} "
                           "is missing); reinstall from a source checkout with `pip install -e .`")
    variant = "".join(f"-{d}" for d in defines)
    tag = "py{}{}-torch{}{}".format(sys.version_info[0], sys.version_info[1],
                                    torch.__version__.replace("+", "_"), variant)
    build_dir = os.path.join(cache_dir(), tag)
    os.makedirs(build_dir, exist_ok=True)
    clear_stale_lock(build_dir)
    logger.warning("genlm_fast: compiling the CPU trie kernels once into %s (about a minute)",
                   build_dir)
    module = load(name="genlm_fast_C" + variant.replace("-", "_").lower(), sources=sources,
                  extra_cflags=[*_CFLAGS, *(f"-D{d}" for d in defines)],
                  extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False)
    return module, build_dir


def load_module():
    """The extension module, building it (CPU only) on first use; None if unavailable."""
    global _module, _origin, _error, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        reasons = []
        try:
            import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

            from genlm_fast import _C  # built by `pip install -e .`

            _module, _origin = _C, "prebuilt"
        except Exception as exc:  # noqa: BLE001
            # ImportError, or an ABI mismatch after a torch upgrade
            reasons.append(f"genlm_fast._C is not built ({type(exc).__name__}: {exc})")
        if _module is None:
            if os.environ.get("GENLM_FAST_NO_JIT") == "1":
                reasons.append("JIT compilation is disabled (GENLM_FAST_NO_JIT=1)")
            else:
                try:
                    _module, _origin = _jit_build()
                except Exception as exc:  # noqa: BLE001
                    # no compiler, no ninja, read-only cache, ...
                    msg = str(exc).strip().splitlines()
                    reasons.append("JIT compilation failed ({}: {})".format(
                        type(exc).__name__, msg[-1] if msg else ""))
        if _module is None:
            _error = "; ".join(reasons) + (
                ". Install a C++ compiler (g++ with OpenMP) and run `pip install -e . "
                "--no-build-isolation` to get the fast CPU path.")
            logger.info("genlm_fast: compiled trie kernels unavailable: %s", _error)
        _tried = True
        return _module


def origin() -> str | None:
    """``"prebuilt"`` (genlm_fast._C), the JIT build directory, or None if not loaded."""
    load_module()
    return _origin


def _cuda_runtime_ok() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def has(kind: str) -> bool:
    """Whether the compiled ``kind`` ("cpu" or "cuda") backend can run in this process."""
    try:
        if kind not in ("cpu", "cuda"):
            return False
        if kind == "cuda" and not _cuda_runtime_ok():
            return False
        module = load_module()
        if module is None:
            return False
        return hasattr(module, "trie_reduce_" + kind)
    except Exception:  # noqa: BLE001  never let a probe break the dispatcher
        return False


def why_missing(kind: str) -> str:
    """A human-readable reason why :func:`has` is False for ``kind`` ("" when it is True)."""
    if has(kind):
        return ""
    if kind not in ("cpu", "cuda"):
        return f"unknown compiled backend {kind!r} (expected 'cpu' or 'cuda')"
    if kind == "cuda" and not _cuda_runtime_ok():
        return "no CUDA device is available to torch (torch.cuda.is_available() is False)"
    module = load_module()
    if module is None:
        return _error or "the extension could not be loaded"
    return ("genlm_fast._C was built without CUDA kernels (the installing torch had no CUDA "
            "or nvcc was not found); reinstall with a CUDA build of torch and CUDA_HOME set: "
            "`pip install -e . --no-build-isolation`")


# --------------------------------------------------------------------------- the backend


def _node_depths(parent):
    """Edges from the root of every node (int64), by pointer jumping: ``jump[n]`` is an
    ancestor of n (itself for a root) at distance ``dist[n]``; doubling the jump
    ceil(log2(depth)) times reaches the roots."""
    import torch

    is_root = parent < 0
    jump = torch.where(is_root, torch.arange(parent.numel()), parent)
    dist = (~is_root).long()
    while not bool(is_root[jump].all()):
        dist = dist + dist[jump]
        jump = jump[jump]
    return dist


def _single_child_runs(parent, leaf_counts, depth):
    """The runs the CPU row sweep steps over (csrc/trie_reduce_cpu.h): maximal chains of
    consecutive node ids in which every node above the first has exactly one child and no
    leaf. In post-order a node's last child is the node just before it, so such a node n
    continues the run of n - 1 and has its value."""
    import torch

    num_nodes = parent.numel()
    children = torch.bincount(parent[parent >= 0], minlength=num_nodes)
    link = (children == 1) & (leaf_counts == 0)  # n holds the value of n - 1
    start = torch.nonzero(~link).flatten()  # node 0 has no child, so it starts a run
    end = torch.cat([start[1:], start.new_tensor([num_nodes])])
    leaf_start = torch.cumsum(leaf_counts, 0) - leaf_counts
    as_i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return {
        "run_end": as_i32(end),
        "run_depth": as_i32(depth[end - 1]),
        "run_child_depth": as_i32(depth[start] + 1),
        "run_leaf": as_i32(torch.cat([leaf_start[start], leaf_counts.sum().reshape(1)])),
        "run_of": as_i32(torch.cumsum((~link).long(), 0) - 1),
    }


def _cpu_arrays(arrays: dict):
    """Index arrays the CPU kernel needs, derived once per (layout, mode) and cached in
    ``arrays`` (the layout's per-device dict): the node of every leaf position (leaf_end is
    cumulative per node in leaf order), the list of empty nodes, the runs of single-child
    links and the maximum depth."""
    cached = arrays.get("_cpu")
    if cached is None:
        import torch

        leaf_end = arrays["leaf_end"].long()
        counts = torch.diff(leaf_end, prepend=leaf_end.new_zeros(1))
        num_nodes = leaf_end.numel()
        leaf_node = torch.repeat_interleave(torch.arange(num_nodes, dtype=torch.int32), counts)
        empty = torch.nonzero(arrays["leaf_start"] == arrays["leaf_end"]).flatten()
        token = arrays["leaf_token"]
        parent = arrays["parent"].long()
        depth = _node_depths(parent)
        cached = {
            "max_depth": int(depth.max()) if depth.numel() else 0,
            "leaf_node": leaf_node.contiguous(),
            "empty": empty.to(torch.int32).contiguous(),
            "min_columns": int(token.max()) + 1 if token.numel() else 0,
            "checked": False,
            **_single_child_runs(parent, counts, depth),
        }
        arrays["_cpu"] = cached
    return cached


def run_cpu_kernel(module, values, arrays: dict, reduction: str, *, check: bool | None = None,
                   num_threads: int = 0):
    """``module.trie_reduce_cpu`` on a layout's arrays. ``check=None`` checks every index on
    the layout's first call only (the arrays are immutable afterwards). A row the kernel
    rejects (NaN; for log_mass also +inf or no finite logit) raises the dispatcher's error."""
    cpu = _cpu_arrays(arrays)
    check = not cpu["checked"] if check is None else check
    out, bad_row = module.trie_reduce_cpu(
        values, arrays["parent"], cpu["leaf_node"], arrays["leaf_token"], cpu["empty"],
        cpu["run_end"], cpu["run_depth"], cpu["run_child_depth"], cpu["run_leaf"],
        cpu["run_of"], cpu["max_depth"], reduction, check, num_threads)
    cpu["checked"] = cpu["checked"] or check
    if bad_row >= 0:
        from genlm_fast.ops.dispatch import raise_bad_row

        raise_bad_row(values, bad_row, reduction)
    return out


def _trie_reduce_cpu(module, values, arrays, reduction, num_nodes):
    cpu = _cpu_arrays(arrays)
    if arrays["parent"].numel() != num_nodes:
        raise ValueError(f"num_nodes={num_nodes} but the layout has "
                         f"{arrays['parent'].numel()} nodes")
    if values.shape[1] < cpu["min_columns"]:
        raise ValueError(f"rows have {values.shape[1]} entries but the vocabulary needs at "
                         f"least {cpu['min_columns']}")
    return run_cpu_kernel(module, values, arrays, reduction)


def _trie_reduce_cuda(module, values, arrays, reduction, num_nodes, num_scratch,
                      max_span_tiles, tile):
    import torch

    cached = arrays.get("_cuda")
    if cached is None:  # one device sync per (layout, mode, device)
        token = arrays["leaf_token"]
        cached = arrays["_cuda"] = {"min_columns": int(token.max()) + 1 if token.numel() else 0}
    if values.shape[1] < cached["min_columns"]:
        raise ValueError(f"rows have {values.shape[1]} entries but the vocabulary needs at "
                         f"least {cached['min_columns']}")
    # per-row workspace: tile totals and pieces, plus the row's log-sum-exp in the last column
    scratch = torch.empty(values.shape[0], num_scratch + 1, dtype=torch.float64,
                          device=values.device)
    return module.trie_reduce_cuda(
        values, arrays["leaf_token"], arrays["tile_range_ptr"], arrays["range_start"],
        arrays["range_end"], arrays["range_dest"], arrays["span_node"], arrays["span_left"],
        arrays["span_right"], arrays["span_tile_lo"], arrays["span_tile_hi"], scratch,
        reduction, num_nodes, num_scratch, max_span_tiles, tile)


def trie_reduce(values, arrays: dict, reduction: str, *, num_nodes: int, num_scratch: int,
                max_span_tiles: int, tile: int):
    """Per-node ``reduction`` of ``values`` ([B, C], contiguous) with the compiled kernels,
    on the values' device. Output float32 (float64 for float64 sum/max)."""
    kind = values.device.type
    if not has(kind):
        raise RuntimeError(f"The {kind!r} trie kernels are not available: {why_missing(kind)}")
    module = load_module()
    if kind == "cpu":
        return _trie_reduce_cpu(module, values, arrays, reduction, num_nodes)
    return _trie_reduce_cuda(module, values, arrays, reduction, num_nodes, num_scratch,
                             max_span_tiles, tile)
