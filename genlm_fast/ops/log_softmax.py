"""``log_softmax_rows``: the op an engine uses to hand out full-vocabulary log-probabilities.

``out[dst[i]] = log_softmax(logits[src[i]])`` in float32, for selected rows of an engine's
logits batch into selected slots of a preallocated buffer. Backends: ``reference`` (plain
torch: gather, a float32 log-softmax within an ulp or two of float64's, scatter; also the
CPU path) and ``triton`` (one fused kernel, ``genlm_fast.kernels.log_softmax_rows``: one
read pass for the normaliser, one read-and-write pass, no [n, V] intermediate). ``"auto"``
picks Triton on CUDA when it is installed.
"""

from __future__ import annotations

import torch

from genlm_fast.ops.dispatch import resolve_reference_or_triton

BACKENDS = ("reference", "triton")
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
TRITON_BLOCK = 1024  # logits per program per step (a row of 128k: 125 steps per pass)


def log_softmax_rows(
    logits: torch.Tensor, src, dst, out: torch.Tensor, backend: str = "auto"
) -> str:
    """Write ``log_softmax(logits[src[i]])`` into ``out[dst[i]]`` for every i; returns the
    backend that ran. ``src``/``dst``: equal-length sequences of row indices (Python ints
    or 1-D integer tensors); ``dst`` entries must be distinct."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits must be a 2-D [rows, vocab] tensor")
    if logits.dtype not in _FLOAT:
        raise TypeError(f"logits must be float16, bfloat16 or float32, got {logits.dtype}")
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.dtype != torch.float32:
        raise ValueError("out must be a 2-D float32 tensor")
    if out.device != logits.device:
        raise ValueError(f"out is on {out.device} but the logits are on {logits.device}")
    if out.shape[1] != logits.shape[1]:
        raise ValueError(f"out rows have {out.shape[1]} entries, the logits {logits.shape[1]}")
    src = torch.as_tensor(src, dtype=torch.int64).reshape(-1)
    dst = torch.as_tensor(dst, dtype=torch.int64).reshape(-1)
    if src.numel() != dst.numel():
        raise ValueError(f"{src.numel()} source rows but {dst.numel()} destination rows")
    if src.numel() and (int(src.min()) < 0 or int(src.max()) >= logits.shape[0]):
        raise IndexError(f"source rows must be in [0, {logits.shape[0]})")
    if dst.numel() and (int(dst.min()) < 0 or int(dst.max()) >= out.shape[0]):
        raise IndexError(f"destination rows must be in [0, {out.shape[0]})")
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError("destination rows must be distinct")
    chosen = resolve_reference_or_triton("log_softmax_rows", backend, logits.device)
    if src.numel() == 0:
        return chosen
    if chosen == "triton":
        from genlm_fast.kernels import log_softmax_rows as kernel

        if logits.stride(1) != 1:
            logits = logits.contiguous()
        # the kernel writes unit-stride rows: a strided `out` gets a contiguous stand-in
        # (not empty_like, which would keep out's strides)
        target = (
            out
            if out.stride(1) == 1
            else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        )
        kernel._log_softmax_rows[(src.numel(),)](
            logits,
            logits.stride(0),
            src.to(logits.device),
            dst.to(logits.device),
            target,
            target.stride(0),
            logits.shape[1],
            BLOCK=TRITON_BLOCK,
        )
        if target is not out:
            out[dst] = target[dst.to(out.device)]
    else:
        # float32 throughout, yet to an ulp or two of float64's answer: the row max m is
        # exact, x - m is exact or rounded once relative to itself, torch's sum of
        # exp(x - m) is a cascade (its error does not grow with the row's length), and
        # (x - m) - log(sum) never rounds a large lse = m + log(sum) to float32. A float64
        # log_softmax costs conversions and 8-byte temporaries.
        rows = logits[src.to(logits.device)].float()
        top = rows.amax(dim=-1, keepdim=True)
        rows -= torch.where(top == float("-inf"), 0.0, top)  # all -inf: NaN, as log_softmax
        rows -= torch.exp(rows).sum(dim=-1, keepdim=True).log_()
        out[dst.to(out.device)] = rows
    return chosen
