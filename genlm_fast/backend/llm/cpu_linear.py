"""The linear layers of a CPU float32 model, run through oneDNN on prepacked weights.

torch's CPU ``nn.Linear`` calls MKL's sgemm. For the short, wide products of incremental
decoding (a few rows against SmolLM2's 576 x 49152 LM head) that runs far below what the
machine can do: ~26 GFLOP/s for 9 rows on this project's 2-core AMD EPYC, 19 ms for the head.
oneDNN's matmul on a weight reordered once into its own blocked layout takes 5 ms for the
same float32 product, and a whole SmolLM2 decoding step goes from ~90 ms to ~45 ms.

`pack_linear_layers` gives every float32 ``nn.Linear`` on the CPU a forward that calls
``torch.ops.mkldnn._linear_pointwise`` on a packed copy of its weight (the op behind
torch.compile's CPU linear fusion). The weight itself is untouched and stays the source of
truth: before each product the layer checks that the copy still matches it and rebuilds it
when the weight was replaced (another tensor or storage), changed in place through torch
(its version counter moves), or changed behind the version counter through ``.data`` (as
peft's ``merge_adapter`` does): a strided sample of 256 of its entries is compared with a
snapshot taken at packing (~2 us), which sees any edit of the whole tensor. An edit of a
few entries through ``.data`` can slip past the sample: then call
`forget_packed_weights(model)`, which drops the copies (repacking SmolLM2 takes ~0.24 s,
which is why ``clear_cache`` does not). Inputs the op does not cover (another
dtype or device, or anything that needs autograd) go to ``F.linear`` as before. The packed
copies cost as much memory as the layers' weights.
A layer whose weight has moved on (``model.to(dtype)``) drops its stale copy at its next
product; a copy of the model (``copy.deepcopy``, ``torch.save``) packs its own weights.

``GENLM_FAST_CPU_LINEAR=torch`` keeps torch's own linear layers.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

__all__ = ["pack_linear_layers", "unpack_linear_layers", "forget_packed_weights",
           "onednn_linear_available"]

logger = logging.getLogger("genlm_fast.backend")

ENV = "GENLM_FAST_CPU_LINEAR"
_PACK = "_genlm_fast_packed_weight"  # a _Packed on the module
_PROBE_SIZE = 256  # weight entries compared with their snapshot before each product
_available = None


def onednn_linear_available() -> bool:
    """Whether this torch build has the packed oneDNN linear and it agrees with F.linear
    (checked once, on a small product against float64)."""
    global _available
    if _available is None:
        _available = False
        try:
            if torch.backends.mkldnn.is_available():
                g = torch.Generator().manual_seed(0)
                x = torch.randn(3, 2, 40, generator=g)
                w = torch.randn(24, 40, generator=g)
                b = torch.randn(24, generator=g)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
                want = F.linear(x.double(), w.double(), b.double())
                _available = got.shape == want.shape and bool(
                    torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4))
        except (AttributeError, RuntimeError) as exc:  # op missing from this build
            logger.info("oneDNN packed linear unavailable (%s)", exc)
    return _available


def _version(weight: torch.Tensor):
    """The version counter of ``weight``, or None for an inference tensor (one created
    under ``torch.inference_mode``), which has none: the sampled snapshot still sees
    edits of the whole tensor."""
    try:
        return weight._version
    except RuntimeError:
        return None


class _Packed:
    """A packed copy of ``weight`` and what tells whether it still matches the weight."""

    def __init__(self, weight: torch.Tensor):
        w = weight.detach()
        self.weight = weight
        self.version = _version(weight)
        self.data_ptr = w.data_ptr()
        flat = w.reshape(-1)  # a view: w is a contiguous float32 CPU weight
        self.probe = flat[:: max(1, flat.numel() // _PROBE_SIZE)]  # shares w's storage
        self.snapshot = self.probe.clone()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)

    def __reduce__(self):
        # The packed weight is an opaque oneDNN tensor, which neither pickles nor deep-copies:
        # a copy of the module (copy.deepcopy, torch.save / torch.load) gets no packed copy,
        # and packs its own weight at its first product.
        return (_no_packed_copy, ())

    def matches(self, weight: torch.Tensor) -> bool:
        return (self.weight is weight and self.version == _version(weight)
                and self.data_ptr == weight.data_ptr()
                and torch.equal(self.probe, self.snapshot))


def _no_packed_copy():
    return None


def _packed_forward(self, x):
    w = self.weight
    state = self.__dict__.get(_PACK)
    if (x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu"
            or w.device.type != "cpu" or x.numel() == 0 or not w.is_contiguous()
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        if state is not None and not state.matches(w):
            # The weight moved on (model.to(dtype) or to(device), say): drop the stale copy
            # now, and with it the old weight storage its snapshot keeps alive, rather than
            # hold both until a float32 product that may never come.
            del self.__dict__[_PACK]
        return F.linear(x, w, self.bias)
    if state is None or not state.matches(w):
        state = self.__dict__[_PACK] = _Packed(w)
    return torch.ops.mkldnn._linear_pointwise(x, state.packed, self.bias, "none", [], "")


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Route ``model``'s float32 CPU ``nn.Linear`` layers through oneDNN on packed weights.

    Returns the number of layers changed: 0 when ``GENLM_FAST_CPU_LINEAR=torch``, when the op
    is unavailable, or when no layer is a float32 CPU linear. `unpack_linear_layers` undoes it.
    """
    choice = os.environ.get(ENV, "onednn").strip().lower()
    if choice not in ("onednn", "torch"):
        raise ValueError(f"{ENV} must be 'onednn' or 'torch', not {choice!r}")
    if choice == "torch" or not onednn_linear_available():
        return 0
    count = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
                and module.weight.device.type == "cpu"):
            # a partial of a module-level function, not a bound method: the module must still
            # pickle (torch.save(model)) and deep-copy, with its copy bound to the copy
            module.forward = functools.partial(_packed_forward, module)
            count += 1
    return count


def unpack_linear_layers(model: torch.nn.Module) -> None:
    """Give ``model``'s linear layers back their own forward and drop the packed copies."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.__dict__.pop("forward", None)
    forget_packed_weights(model)


def forget_packed_weights(model: torch.nn.Module) -> None:
    """Drop the packed copies; the next product of each layer packs its weight afresh."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.__dict__.pop(_PACK, None)
