"""Triton kernel: log-softmax of selected logit rows into selected rows of a buffer
(launched by ``genlm_fast.ops.log_softmax``).

``out[dst[i], :] = logits[src[i], :] - logsumexp(logits[src[i], :])`` for i < n, float32.
It is how an inference engine hands out full-vocabulary log-probabilities: the engine's
logits batch stays where it is, and each captured request's row lands in its own slot of a
preallocated buffer, with no [n, V] intermediate.

Algorithm: one program per selected row. Pass 1 reads the row once, coalesced, keeping an
online (max, sum of exp(x - max)) pair per lane with one exp per element; the lanes merge
into (max, log(sum)). Pass 2 reads the row again (from L2 for a row of a few hundred KB)
and writes (x - max) - log(sum). Every exp argument is <= 0, so nothing overflows; the sum
accumulates in float32 terms <= 1 (relative error ~V * 2^-24 at worst, far below the
float32 output's own rounding of x - lse for |x - lse| >= 1). -inf logits give -inf.
lse = max + log(sum) is never rounded to one float32: that would put half an ulp of |lse|
into every output (2.4e-4 for logits near 6000, 2e-3 near 65000: a small temperature,
fp16 logits at the top of their range). max is a logit (exact), x - max is exact
(Sterbenz) or rounded relative to |x - max|, and log(sum) is in [0, log V].
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_lse_update(m, s, x):
    """One step of a per-lane online log-sum-exp: (max m, sum s of exp(. - m)) absorbs x."""
    mx = tl.maximum(m, x)
    mn = tl.minimum(m, x)
    e = tl.where(mx == float("-inf"), 0.0, tl.exp(mn - mx))
    s = tl.where(x > m, s * e + 1.0, s + e)
    return mx, s


@triton.jit
def lse_merge(m, s):
    """Per-lane (max, sum) pairs -> (max over lanes, sum rescaled to it)."""
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    return big, tl.sum(s * tl.exp(m - big_safe), axis=0)


@triton.jit
def _log_softmax_rows(
    x_ptr, x_stride, src_ptr, dst_ptr, out_ptr, out_stride, V, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    row = x_ptr + src * x_stride
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for k in range(0, V, BLOCK):
        x = tl.load(row + k + offs, mask=k + offs < V, other=float("-inf")).to(tl.float32)
        m, s = online_lse_update(m, s, x)
    big, total = lse_merge(m, s)
    log_total = tl.log(total)  # lse = big + log_total, kept as the pair (see above)
    dst_row = out_ptr + dst * out_stride
    for k in range(0, V, BLOCK):
        mask = k + offs < V
        x = tl.load(row + k + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst_row + k + offs, (x - big) - log_total, mask=mask)
