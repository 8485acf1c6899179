"""One dispatcher for ``trie_reduce``: validate the input once, pick a backend, run it.

Every backend module (``reference``, ``triton_backend``, ``cpu_backend``, ``cuda_backend``)
implements the same function, on inputs this module has already checked::

    trie_reduce(values, arrays, reduction, *, num_nodes, num_scratch, tile, float64_result)
        -> (Tensor[B, num_nodes] on values.device, row_check or None)

``values``: [B, C] contiguous, B >= 1, float32/float64 (``sum``/``max``) or any float dtype
(``log_mass``). Rows holding a NaN (and for ``log_mass`` a +inf, or no finite logit) are
errors. The dispatcher finds them with one pass over the values before the backend runs
(:func:`row_check`), unless the backend checks them itself (:func:`backend_checks_rows`):
the ``cpu`` kernel checks each row as it reads it and raises, the ``cuda`` row pass returns
a ``row_check`` of its own (the second item of the result; None elsewhere), each read on the
host once the kernels are enqueued. ``arrays``: the index tensors the backend reads, for
the mode, on the values' device (``TrieLayout.device_arrays``); a backend may cache what it
derives from them there under a ``_<name>`` key. ``num_scratch`` and ``tile`` come from
the mode's ``ModeLayout``. The result dtype is :func:`result_dtype`: ``float64_result`` asks
for float64 sum/max of float32 values, the same numbers as on ``values.double()`` (the
conversion is exact) without that [B, C] copy where the backend can read float32.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch

from genlm_fast.ops.layout import TrieLayout

logger = logging.getLogger("genlm_fast.ops")

BACKENDS = ("reference", "triton", "cuda", "cpu")
REDUCTIONS = ("sum", "max", "log_mass")
# "auto" on a GPU, fastest first, for every reduction: with the Llama-3 vocabulary, kernels
# alone, CUDA is ahead of Triton at every batch size and for every op on the GPUs measured
# (`python -m tools.gpu.bench`; docs/gpu.md lists the runs).
GPU_PREFERENCE = ("cuda", "triton")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_warned = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _kernels_interpreted() -> bool | None:
    """Whether genlm_fast's Triton kernels were made for the interpreter: triton decides
    when a kernel is defined (its module imported), by TRITON_INTERPRET then. None when
    they are not imported yet (the environment now decides)."""
    module = sys.modules.get("genlm_fast.kernels.trie_reduce")
    if module is None:
        return None
    kinds = {type(value).__name__ for value in vars(module).values()}
    if "InterpretedFunction" in kinds:
        return True
    return False if "JITFunction" in kinds else None


def triton_unusable_reason(device: torch.device) -> str:
    """Why the 'triton' backend cannot run on ``device`` ("" when it can)."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        return f"Triton runs on CUDA tensors (or CPU ones under its interpreter), not {device.type}"
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return (
                "a CPU tensor needs the Triton interpreter: TRITON_INTERPRET=1 set before "
                "triton is imported"
            )
        if _kernels_interpreted() is False:
            return (
                "TRITON_INTERPRET=1 was set after genlm_fast's Triton kernels were compiled "
                "for the GPU (imported); set it at the start of the process"
            )
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001  ImportError, or a broken install
        return f"triton cannot be imported ({type(exc).__name__}: {exc})"
    return ""


def triton_usable(device: torch.device) -> bool:
    return not triton_unusable_reason(device)


def require_triton(device: torch.device):
    """Raise the error that says why the 'triton' backend cannot run on ``device``, if so."""
    reason = triton_unusable_reason(device)
    if reason:
        raise RuntimeError(
            f"The 'triton' backend cannot run on this {torch.device(device).type} tensor: {reason}."
        )


def resolve_reference_or_triton(op: str, backend: str, device) -> str:
    """The backend of an op offered as ``reference`` and ``triton`` that ``backend`` names on
    ``device``: ``"auto"`` is Triton on CUDA where it runs, else the reference."""
    device = torch.device(device)
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device) else "reference"
    if backend not in ("reference", "triton"):
        raise ValueError(
            f"unknown {op} backend {backend!r}; expected 'auto', 'reference' or 'triton'"
        )
    if backend == "triton":
        require_triton(device)
    return backend


def _extension_usable(kind: str, device: torch.device) -> bool:
    if device.type != kind:
        return False
    from genlm_fast.ops import extension  # never raises: a missing build is has() == False

    return extension.has(kind)


def available_backends(device="cpu") -> list[str]:
    """Backends that can run on ``device`` in this process (on a GPU, "auto" picks the
    first of ``GPU_PREFERENCE`` among them)."""
    device = torch.device(device)
    found = []
    if device.type == "cuda":
        if triton_usable(device):
            found.append("triton")
        if _extension_usable("cuda", device):
            found.append("cuda")
    else:
        if _extension_usable("cpu", device):
            found.append("cpu")
        if triton_usable(device):
            found.append("triton")
    found.append("reference")
    return found


def _fallback_message(device: torch.device) -> str:
    """The warning when "auto" ends on the reference: which fast paths are missing and why."""
    reasons = []
    kinds = ("cuda",) if device.type == "cuda" else ("cpu",) if device.type == "cpu" else ()
    for kind in kinds:
        try:
            from genlm_fast.ops import extension

            reasons.append(f"The {kind!r} kernels: {extension.why_missing(kind)}")
        except Exception as exc:  # noqa: BLE001
            reasons.append(f"The {kind!r} kernels: {type(exc).__name__}: {exc}")
    if device.type == "cuda":
        reasons.append(f"The 'triton' kernels: {triton_unusable_reason(device)}")
    return (
        f"genlm_fast: no fast trie kernel for device {device.type!r}; using the plain-torch "
        "reference (slow). "
        + " ".join(r if r.endswith(".") else r + "." for r in reasons)
        + " `python -m genlm_fast info` shows what is built."
    )


def resolve_backend(backend: str, device, reduction: str = "log_mass") -> str:
    """The concrete backend ``backend`` means on ``device`` ("auto" picks the fastest for
    ``reduction``)."""
    device = torch.device(device)
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    if backend == "auto":
        if device.type == "cuda":
            available = available_backends(device)
            choice = next((b for b in GPU_PREFERENCE if b in available), "reference")
        else:
            # the Triton interpreter is a correctness tool, never the CPU fast path
            choice = "cpu" if _extension_usable("cpu", device) else "reference"
        if choice == "reference":
            _warn_once(("auto", device.type), _fallback_message(device))
        return choice
    if backend not in BACKENDS:
        raise ValueError(f"Unknown trie backend {backend!r}; expected 'auto' or one of {BACKENDS}")
    if backend == "triton":
        require_triton(device)
    if backend in ("cuda", "cpu"):
        if device.type != backend:
            raise ValueError(
                f"The {backend!r} backend needs a {backend} tensor, got one on {device}."
            )
        from genlm_fast.ops import extension

        if not extension.has(backend):
            raise RuntimeError(
                f"The {backend!r} backend is not built: {extension.why_missing(backend)}"
            )
    return backend


def _backend_module(backend: str):
    if backend == "reference":
        from genlm_fast.ops import reference as module
    elif backend == "triton":
        from genlm_fast.ops import triton_backend as module
    elif backend == "cpu":
        from genlm_fast.ops import cpu_backend as module
    else:
        from genlm_fast.ops import cuda_backend as module
    return module


def result_dtype(reduction: str, dtype: torch.dtype, float64_result: bool = False) -> torch.dtype:
    """The dtype of every backend's result: float64 for float64 sum/max (or any sum/max with
    ``float64_result``), else float32."""
    wide = dtype == torch.float64 or float64_result
    return torch.float64 if wide and reduction != "log_mass" else torch.float32


def check_device(values: torch.Tensor):
    """The kernels run on CPU and CUDA tensors only: name any other device (meta, mps ...)."""
    if values.device.type not in ("cpu", "cuda"):
        raise ValueError(f"expected a tensor on cpu or cuda, got one on {values.device}")


def validate_values(values, layout: TrieLayout, exact_width: int | None = None):
    """Check a ``[B, C]`` value/logit tensor's type, device and shape; raise a clear error
    naming the problem. Its entries are checked by :func:`row_check` (or by the backend)."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of values, got {type(values).__name__}")
    check_device(values)
    if values.dim() != 2:
        raise ValueError(f"expected a 2-D [batch, vocab] tensor, got shape {tuple(values.shape)}")
    if values.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"expected a floating-point tensor (float16/bfloat16/float32/float64), "
            f"got {values.dtype}"
        )
    width = values.shape[1]
    if exact_width is not None and width != exact_width:
        raise ValueError(
            f"expected rows of length {exact_width} (one entry per token id), got {width}"
        )
    if width < layout.num_columns:
        raise ValueError(
            f"rows have {width} entries but the vocabulary needs at least {layout.num_columns}"
        )


def row_check(values: torch.Tensor) -> torch.Tensor | None:
    """A row check: a [B] float tensor on the values' device that is NaN for a row holding a
    NaN and, for log_mass, non-finite for a row with a +inf or no finite logit (each row's
    largest value: amax propagates NaN), None for no rows. No device sync:
    :func:`raise_bad_rows` reads it."""
    return values.amax(dim=1) if values.shape[0] else None


def raise_bad_rows(values: torch.Tensor, check: torch.Tensor | None, reduction: str):
    """Raise for the first row a row check (:func:`row_check`, or a backend's: NaN or, for
    log_mass, non-finite exactly for the bad rows) rejects, if any. One copy of B values to
    the host (the device sync), the verdict taken there."""
    if check is None:
        return
    check = check.cpu()
    bad = ~torch.isfinite(check) if reduction == "log_mass" else torch.isnan(check)
    if bool(bad.any()):
        raise_bad_row(values, int(bad.nonzero()[0, 0]), reduction)


def raise_bad_row(values: torch.Tensor, row: int, reduction: str):
    """The error for a row that a row check or the CPU kernel rejected."""
    if reduction == "log_mass":
        v = float(values[row].amax())
        what = (
            "contains NaN"
            if v != v
            else "contains +inf"
            if v > 0
            else "has no finite logit (all -inf)"
        )
        raise ValueError(f"logit row {row} {what}: log-masses would be undefined")
    if reduction == "sum" and not bool(values[row].isnan().any()):
        if bool(values[row].isposinf().any()) and bool(values[row].isneginf().any()):
            raise ValueError(f"weight row {row} holds both +inf and -inf: their sum is undefined")
        raise ValueError(
            f"weight row {row}: its finite weights sum past the float range to "
            f"both +inf and -inf, whose sum is undefined (largest magnitude "
            f"{float(values[row].abs().max()):.3g})"
        )
    raise ValueError(f"weight row {row} contains NaN")


def backend_checks_rows(backend: str) -> bool:
    """Whether ``backend`` checks the rows itself (the dispatcher then makes no pass)."""
    return _backend_module(backend).CHECKS_ROWS


def trie_reduce(
    values: torch.Tensor,
    layout: TrieLayout,
    reduction: str,
    mode: str = "without_eos",
    backend: str = "auto",
    exact_width: int | None = None,
    float64_result: bool = False,
) -> tuple[torch.Tensor, str]:
    """Per-node values ``[B, N]`` on ``values.device``; returns (result, backend used).
    ``float64_result``: float64 sum/max whatever the values' float dtype."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    if float64_result and reduction == "log_mass":
        raise ValueError("float64_result is for sum and max; log_mass results are float32")
    if mode not in layout.modes:
        raise ValueError(f"this trie has no {mode!r} mode (modes: {sorted(layout.modes)})")
    validate_values(values, layout, exact_width)
    chosen = resolve_backend(backend, values.device, reduction)
    # The verdict on the rows (see the module docstring) is read once the kernels are
    # enqueued: on a GPU they then run without waiting for the host to read it (a bad row's
    # results are computed, then dropped with the error).
    check = None if backend_checks_rows(chosen) else row_check(values)
    out, backend_check = run_backend(values, layout, reduction, mode, chosen, float64_result)
    check = backend_check if backend_check is not None else check
    if reduction == "sum" and out.shape[0]:
        # a row holding both +inf and -inf sums to NaN, at its root at least (which holds
        # every leaf): read in the same copy as the row check
        root = out[:, layout.root]
        check = root if check is None else torch.where(torch.isnan(root), root, check)
    raise_bad_rows(values, check, reduction)
    logger.debug(
        "trie_reduce %s %s B=%d N=%d on %s via %s",
        reduction,
        mode,
        values.shape[0],
        layout.num_nodes,
        values.device,
        chosen,
    )
    return out, chosen


def run_backend(
    values: torch.Tensor,
    layout: TrieLayout,
    reduction: str,
    mode: str,
    backend: str,
    float64_result: bool = False,
):
    """Run one concrete backend on values :func:`trie_reduce` has validated (and checked
    row by row, unless the backend does that itself): (result, row_check or None), the
    backend contract's pair. ``tools.gpu.bench`` times this directly."""
    if reduction != "log_mass" and values.dtype in (torch.float16, torch.bfloat16):
        values = values.float()
    # Node values are not differentiable: every backend gets a plain tensor (the reference
    # would otherwise record autograd history, and fail when the layout's index tensors
    # were made under torch.inference_mode()).
    values = values.detach().contiguous()
    if values.shape[0] == 0:
        return torch.empty(
            0,
            layout.num_nodes,
            dtype=result_dtype(reduction, values.dtype, float64_result),
            device=values.device,
        ), None
    ml = layout.modes[mode]
    return _backend_module(backend).trie_reduce(
        values,
        layout.device_arrays(mode, values.device, backend),
        reduction,
        num_nodes=layout.num_nodes,
        num_scratch=ml.num_scratch,
        tile=ml.tile,
        float64_result=float64_result,
    )
