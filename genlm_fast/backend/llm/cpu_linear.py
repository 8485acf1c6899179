"""The linear layers of a CPU float32 model, on kernels made for the few rows of decoding.

torch's CPU ``nn.Linear`` calls MKL's sgemm. A decoding step multiplies a few rows (one per
sequence) by every weight of the model, a product bound by reading the weights from memory,
and sgemm runs it far below what the machine can do. Two kernels do better:

* ``avx512``: genlm_fast's small-batch kernel (``csrc/linear_cpu.cpp``, in ``genlm_fast._C``),
  on CPUs with AVX-512F, for products of up to `SMALL_BATCH_ROWS` rows, on a copy of each
  weight packed once into its panel layout; larger ones (prompt prefills) go to
  ``F.linear``, whose BLAS kernels are made for them (``python -m bench.linear`` compares it
  with MKL and oneDNN).
* ``rows``: ``genlm_fast._C.linear_rows`` (``csrc/linear_rows_cpu.cpp``) on the weight in
  place, no copy, for products of up to `widen.ROWS` rows (`widen.product`); the choice where
  AVX-512 is missing and the extension's AVX2 kernel runs.

`pack_linear_layers` gives every float32 ``nn.Linear`` on the CPU a forward that runs the
kernel. With ``avx512`` the weight itself is untouched and stays the source of truth: before
each product the layer checks that its packed copy still matches it and rebuilds it when the
weight was replaced (another tensor or storage), changed in place through torch (its version
counter moves), or changed behind the version counter through ``.data`` (as peft's
``merge_adapter`` does): a strided sample of `_PROBE_SIZE` of its entries is compared with a
snapshot taken at packing, which sees any edit of the whole tensor. An edit of a few entries
through ``.data`` can slip past the sample: `AsyncTransformer.reload_weights` announces it,
and `drop_packed_copies` then drops the copies (repacking SmolLM2 takes a fraction of a
second, which is why ``clear_cache`` does not). The packed copies cost as much memory as the
layers' weights; ``rows`` has none, so nothing can go stale. Inputs the kernels do not cover
(another dtype or device, or anything that needs autograd) go to ``F.linear`` as before. A
layer whose weight has moved on (``model.to(dtype)``) drops its stale copy at its next
product; a copy of the model (``copy.deepcopy``, ``torch.save``) packs its own weights.

The ``kernel`` argument of `pack_linear_layers` picks the kernel: ``auto`` (the default:
``avx512`` where it runs, else ``rows`` where it runs, else torch's own layers), ``avx512``,
``rows`` or ``torch``.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
import torch.nn.functional as F

from genlm_fast.backend.llm.memory import shortfall
from genlm_fast.backend.llm.widen import _rows_module, product

__all__ = [
    "pack_linear_layers",
    "unpack_linear_layers",
    "drop_packed_copies",
    "available_kernels",
    "choose_kernel",
    "SMALL_BATCH_ROWS",
]

logger = logging.getLogger("genlm_fast.backend")

KERNELS = ("avx512", "rows")  # in order of preference
SMALL_BATCH_ROWS = 48  # the avx512 kernel's products: up to this many rows (bench/linear.py)
_PACK = "_genlm_fast_packed_weight"  # a _Packed on the module
_PROBE_SIZE = 64  # weight entries compared with their snapshot before each product
_available = {}


def _small_batch_module():
    """genlm_fast._C if it has the small-batch linear and this CPU runs its AVX-512 kernel."""
    from genlm_fast.ops import extension

    module = extension.load_module()
    if module is None or not hasattr(module, "linear_small_batch"):
        return None
    return module if module.linear_best_isa() == "avx512" else None


def _rows_runs() -> bool:
    """Whether genlm_fast._C has `linear_rows` and this CPU runs its AVX2 or AVX-512 kernel
    (its plain loop is the tests' reference, slower than torch's own layers)."""
    module = _rows_module()
    return module is not None and module.linear_rows_best_isa() in ("avx2", "avx512")


def available_kernels() -> list[str]:
    """The kernels that run here, in order of preference (checked once each)."""
    for kernel in KERNELS:
        if kernel not in _available:
            try:
                _available[kernel] = (
                    _small_batch_module() is not None if kernel == "avx512" else _rows_runs()
                )
            except (AttributeError, RuntimeError) as exc:  # op missing from this build
                logger.info("CPU linear kernel %s unavailable (%s)", kernel, exc)
                _available[kernel] = False
    return [kernel for kernel in KERNELS if _available[kernel]]


def choose_kernel(kernel: str = "auto"):
    """The kernel that ``kernel`` (``auto``, ``avx512``, ``rows`` or ``torch``) names and
    that runs here, or None for torch's own layers.

    Raises:
        ValueError: ``kernel`` names no kernel, or one that does not run here.
    """
    if kernel not in ("auto", "torch") + KERNELS:
        raise ValueError(
            f"CPU linear kernel must be 'auto', 'avx512', 'rows' or 'torch', not {kernel!r}"
        )
    if kernel == "torch":
        return None
    runs = available_kernels()
    if kernel == "auto":
        return runs[0] if runs else None
    if kernel not in runs:
        raise ValueError(
            f"CPU linear kernel {kernel}: that kernel does not run here (available: "
            f"{', '.join(runs) or 'none'}; 'avx512' needs genlm_fast._C and a CPU "
            "with AVX-512F, 'rows' genlm_fast._C and a CPU with AVX2)"
        )
    return kernel


def _version(weight: torch.Tensor):
    """The version counter of ``weight``, or None for an inference tensor (one created
    under ``torch.inference_mode``), which has none: the sampled snapshot still sees
    edits of the whole tensor."""
    try:
        return weight._version
    except RuntimeError:
        return None


class _Packed:
    """A packed copy of ``weight`` (avx512's panels) and what tells whether it still matches
    the weight."""

    def __init__(self, weight: torch.Tensor):
        w = weight.detach()
        self.weight = weight
        self.version = _version(weight)
        self.data_ptr = w.data_ptr()
        flat = w.reshape(-1)  # a view: w is a contiguous float32 CPU weight
        self.probe = flat[:: max(1, flat.numel() // _PROBE_SIZE)]  # shares w's storage
        self.snapshot = self.probe.clone()
        self.module = _small_batch_module()  # genlm_fast._C
        self.packed = self.module.pack_linear_weight(w)

    def __reduce__(self):
        # a copy of the module (copy.deepcopy, torch.save / torch.load) gets no packed copy,
        # and packs its own weight at its first product
        return (_no_packed_copy, ())

    def matches(self, weight: torch.Tensor) -> bool:
        return (
            self.weight is weight
            and self.version == _version(weight)
            and self.data_ptr == weight.data_ptr()
            and torch.equal(self.probe, self.snapshot)
        )


def _no_packed_copy():
    return None


def _packed_forward(self, kernel, x):
    w, bias = self.weight, self.bias
    state = self.__dict__.get(_PACK)
    if (
        x.dtype != torch.float32
        or w.dtype != torch.float32
        or x.device.type != "cpu"
        or w.device.type != "cpu"
        or x.numel() == 0
        or not w.is_contiguous()
        or (bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"))
        or (
            torch.is_grad_enabled()
            and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad))
        )
    ):
        if state is not None and not state.matches(w):
            # The weight moved on (model.to(dtype) or to(device), say): drop the stale copy
            # now, and with it the old weight storage its snapshot keeps alive, rather than
            # hold both until a float32 product that may never come.
            del self.__dict__[_PACK]
        return F.linear(x, w, bias)
    if kernel == "rows":  # the weight in place: linear_rows, or BLAS for a prefill
        return product(x, w, bias)
    rows = x.numel() // x.shape[-1]
    if rows > SMALL_BATCH_ROWS:  # a prefill: BLAS's kernels are made for it
        return F.linear(x, w, bias)
    if state is None or not state.matches(w):
        state = self.__dict__[_PACK] = _Packed(w)
    y = state.module.linear_small_batch(
        x.reshape(rows, x.shape[-1]).contiguous(),
        state.packed,
        None if bias is None else bias.detach().contiguous(),
        w.shape[0],
    )
    return y.view(*x.shape[:-1], w.shape[0])


def pack_linear_layers(model: torch.nn.Module, kernel: str = "auto") -> int:
    """Route ``model``'s float32 CPU ``nn.Linear`` layers through ``kernel``
    (`choose_kernel`; module docstring).

    Returns the number of layers changed: 0 when the choice is ``torch``, when no kernel runs
    here, when no layer is a float32 CPU linear, or when their packed copies would not fit
    in the memory this process may still take (`memory.shortfall`: with a warning; avx512
    only, the one that copies).
    `unpack_linear_layers` undoes it.

    Raises:
        ValueError: ``kernel`` names no kernel, or one that does not run here.
    """
    kernel = choose_kernel(kernel)
    if kernel is None:
        return 0
    layers = [
        module
        for module in model.modules()
        if type(module) is torch.nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    ]
    if kernel == "avx512":  # a packed copy of each weight
        weights = {id(m.weight): m.weight for m in layers}.values()  # tied weights once
        short = shortfall(
            sum(w.numel() * w.element_size() for w in weights),
            f"packing the linear layers for the {kernel} kernel",
        )
        if short is not None:
            warnings.warn(f"{short}: they run torch's own layers", RuntimeWarning, stacklevel=3)
            return 0
    for module in layers:
        # a partial of a module-level function, not a bound method: the module must still
        # pickle (torch.save(model)) and deep-copy, with its copy bound to the copy
        module.forward = functools.partial(_packed_forward, module, kernel)
    return len(layers)


def unpack_linear_layers(model: torch.nn.Module) -> None:
    """Give ``model``'s linear layers back their own forward and drop the packed copies."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func is _packed_forward:
            del module.__dict__["forward"]
    drop_packed_copies(model)


def drop_packed_copies(model: torch.nn.Module) -> None:
    """Drop the packed copies; the next product of each layer packs its weight afresh
    (`model_state.ModelState` does, when the model's weights changed)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.__dict__.pop(_PACK, None)
