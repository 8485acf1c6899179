"""A 16-bit CPU model's transformers forward, computed in float32 on its weights as stored.

The fused decoder computes in float32 whatever the model's dtype. transformers' forward of a
bfloat16 or float16 model computes in that dtype, rounding every layer's output to 16 bits:
a prompt too long for the fused forward, or any context on a CPU without the fused decoder,
would get other log-probabilities than the fused decoder's for the same context (half a nat
apart on a 1 B bfloat16 model), and the key/value states stored from such a forward would
carry the error into the steps after it. `widen_forward` makes that forward a float32 one
without a float32 copy of the weights:

* ``nn.Embedding``: the rows it returns are widened (exact: every 16-bit value is a float32);
* ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2): products of up to `ROWS` rows run
  ``genlm_fast._C.linear_rows`` (csrc/linear_rows_cpu.cpp), which widens each weight as it is
  loaded and sums in float32; larger ones (prompt prefills) multiply by BLAS slices of the
  weight widened one at a time (`SLICE_BYTES`), so that at most one slice's float32 copy
  exists;
* ``nn.LayerNorm``: its weight and bias are widened (vectors) for each call;
* the RMS norms of the families the fused decoder serves (``...RMSNorm``): nothing; they
  compute in float32 and scale by their 16-bit weight, which a float32 input promotes;
* peft's adapter layers: their casting of the input to the weights' dtype is turned off.

From the embedding to the logits the hidden states are then float32, and what follows their
dtype (attention, rotary embeddings, masks, the key/value states) is float32 too. A model
holding 16-bit parameters in any other kind of module keeps its 16-bit forward: `why_not`
names the module.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = [
    "widen_forward",
    "unwiden_forward",
    "is_widened",
    "compute_dtype",
    "why_not",
    "linear_forward",
]

ROWS = 48  # products of up to this many rows read the weight in place (linear_rows)
SLICE_BYTES = 16 << 20  # a larger product widens its weight in float32 slices of this size
_HALF = (torch.bfloat16, torch.float16)
_MARK = "_genlm_fast_widened"  # set on a model whose forward was widened
_UNCAST = "_genlm_fast_uncast"  # set on a peft layer whose input casting was turned off


def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _is_rms_norm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def _half_params(module):
    return [p for p in module.parameters(recurse=False) if p.dtype in _HALF]


def why_not(model: torch.nn.Module) -> str | None:
    """Why `widen_forward` leaves ``model``'s forward as it is, or None if it widens it."""
    params = list(model.parameters())
    if not params or all(p.dtype not in _HALF for p in params):
        return "its parameters are not bfloat16 or float16"
    if any(p.device.type != "cpu" for p in params):
        return "its parameters are not all on the CPU"
    for name, module in model.named_modules():
        if not _half_params(module):
            continue
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)):
            continue
        if _is_conv1d(module) or _is_rms_norm(module):
            continue
        return f"{name or 'the model'} ({type(module).__name__}) holds 16-bit parameters"
    return None


@functools.cache
def _rows_module():
    """genlm_fast._C if it has `linear_rows`, else None (products then widen slices)."""
    from genlm_fast.ops import extension

    module = extension.load_module()
    return module if module is not None and hasattr(module, "linear_rows") else None


def product(x: torch.Tensor, weight_nk: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight_nk.T + bias`` in float32: x ``[..., K]`` (widened if 16-bit), the weight
    ``[N, K]`` (any dtype and strides) and the bias read as they are stored. Up to `ROWS`
    rows: `linear_rows`; more: BLAS (``F.linear`` on a float32 weight, slices of a 16-bit one
    widened one at a time)."""
    x = x.float()
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight_nk.shape[0]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    module = _rows_module()
    if torch.is_grad_enabled() and (x.requires_grad or weight_nk.requires_grad):
        out = F.linear(x2, weight_nk.float(), None if bias is None else bias.float())
    elif module is not None and rows <= ROWS and (weight_nk.stride(1) == 1 or k <= 1):
        out = module.linear_rows(x2.contiguous(), weight_nk.detach(), _detach(bias))
    elif weight_nk.dtype == torch.float32:
        out = F.linear(x2, weight_nk.detach(), None if bias is None else bias.detach().float())
    else:
        out = torch.empty((rows, n), dtype=torch.float32, device=x.device)
        step = max(1, SLICE_BYTES // max(1, 4 * k))
        for a in range(0, n, step):
            b = min(n, a + step)
            torch.matmul(x2, weight_nk.detach()[a:b].float().t(), out=out[:, a:b])
        if bias is not None:
            out += bias.detach().float()
    return out.view(*lead, n)


def _detach(t):
    return None if t is None else t.detach()


# The forwards below compute as the module's own where its weight is no longer 16-bit (the
# model, or a copy of it, was converted since): ``x`` in its dtype, none widened.


def _linear_forward(module, x):
    if module.weight.dtype not in _HALF:
        return F.linear(x, module.weight, module.bias)
    return product(x, module.weight, module.bias)


def _conv1d_forward(module, x):
    if module.weight.dtype not in _HALF:
        return type(module).forward(module, x)
    return product(x, module.weight.t(), module.bias)  # Conv1D's weight is [K, N]


def linear_forward(module, x):
    """An ``nn.Linear``'s or ``Conv1D``'s forward as `widen_forward` gives it: float32 on a
    16-bit weight as stored, else the module's own."""
    return _conv1d_forward(module, x) if _is_conv1d(module) else _linear_forward(module, x)


def _layer_norm_forward(module, x):
    if module.weight is not None and module.weight.dtype not in _HALF:
        return type(module).forward(module, x)
    w = None if module.weight is None else module.weight.float()
    b = None if module.bias is None else module.bias.float()
    return F.layer_norm(x.float(), module.normalized_shape, w, b, module.eps)


def _widen_output(module, args, output):
    return output.float() if output.dtype in _HALF else output


_FORWARDS = (_linear_forward, _conv1d_forward, _layer_norm_forward)


def widen_forward(model: torch.nn.Module) -> str | None:
    """Make ``model``'s forward compute in float32 on its 16-bit weights as they are
    (module docstring). Returns None when it did, else why not (`why_not`). Called again
    after the model changed (an adapter loaded), it widens the modules added since; a model
    that can no longer be widened gets its own forward back whole. `unwiden_forward` undoes
    it."""
    reason = why_not(model)
    if reason is not None:
        unwiden_forward(model)
        return reason
    hooked = model.__dict__.setdefault(_MARK, [])  # (embedding, its hook's handle)
    for module in model.modules():
        if getattr(module, "cast_input_dtype_enabled", False):
            # a peft adapter layer would round its float32 input to its weights' dtype: the
            # widened layers below it take float32 (peft's switch for forward hooks that
            # cast, as these do)
            module.cast_input_dtype_enabled = False
            module.__dict__[_UNCAST] = True
        if not _half_params(module) or "forward" in module.__dict__:
            continue
        # partials of module-level functions, not bound methods: the model must still pickle
        # and deep-copy (a copy is bound to its copy)
        if isinstance(module, torch.nn.Linear):
            module.forward = functools.partial(_linear_forward, module)
        elif _is_conv1d(module):
            module.forward = functools.partial(_conv1d_forward, module)
        elif isinstance(module, torch.nn.LayerNorm):
            module.forward = functools.partial(_layer_norm_forward, module)
        elif isinstance(module, torch.nn.Embedding) and all(m is not module for m, _ in hooked):
            hooked.append((module, module.register_forward_hook(_widen_output)))
    return None


def unwiden_forward(model: torch.nn.Module) -> None:
    """Give ``model`` back its own 16-bit forward."""
    hooked = model.__dict__.pop(_MARK, None)
    if hooked is None:
        return
    for _, handle in hooked:
        handle.remove()
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func in _FORWARDS:
            del module.__dict__["forward"]
        if module.__dict__.pop(_UNCAST, False):
            module.cast_input_dtype_enabled = True


def is_widened(model: torch.nn.Module) -> bool:
    return _MARK in model.__dict__


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``model``'s forward computes and returns its states in."""
    return torch.float32 if is_widened(model) else model.dtype
