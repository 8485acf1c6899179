"""Triton kernel: attention of query tokens over a paged key/value pool, read in place
(launched by ``genlm_fast.ops.paged_attention``).

The pool holds one layer's keys and values as ``[slots, kv_heads, head_dim]``; slot
``block * PAGE + offset`` is position ``offset`` of block ``block``. A row's past is its
block table: position ``n`` of row ``b`` lives in slot ``table[b, n // PAGE] * PAGE +
n % PAGE``. Each query token ``(b, t)`` has an absolute position ``pos`` (-1: padding, whose
output is 0) and attends to the row's positions ``[max(0, pos + 1 - window), pos]``: its own
key and value are in the pool already (written before the attention), so a decoding step
and a prefill are the same computation, causal by the position alone.

Algorithm: one program per query token and key/value head. It loads the ``GROUP`` query
heads that share the key/value head (GQA; padded to ``BLOCK_G`` >= 16 rows for ``tl.dot``),
then walks the visible positions ``BLOCK_N`` at a time: the block table gives each
position's slot, the keys and values of those slots are loaded once for all the group's
heads, and an online softmax (running max ``m``, running sum ``total``, rescaled accumulator)
absorbs the tile. Products run in float32 (``input_precision="ieee"``: no TF32 rounding),
so a 16-bit pool's values are widened exactly and the result is the float32 attention of
the stored states. Positions outside the window, past ``pos`` or in padded lanes load 0 and
score -inf: they weigh exactly 0, and what a pool's unused slots hold never reaches the
result. The loop bounds are read from the positions, so one compiled launch (one recorded
CUDA graph) serves every past length that the table's width allows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _paged_attention(
    q_ptr,
    q_stride_b,
    q_stride_h,
    q_stride_t,
    k_ptr,
    v_ptr,
    kv_stride_slot,
    kv_stride_head,
    table_ptr,
    table_stride_b,
    pos_ptr,
    out_ptr,
    out_stride_b,
    out_stride_t,
    out_stride_h,
    T,
    scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = token // T
    t = token % T
    pos = tl.load(pos_ptr + token)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * q_stride_b + t * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)

    end = pos + 1  # visible positions are [start, end); 0 for padding (pos == -1)
    start = tl.maximum(end - window, 0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = table_ptr + b * table_stride_b
    kv_offset = kv_head * kv_stride_head
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = block * PAGE + n % PAGE
        addr = slot[:, None] * kv_stride_slot + kv_offset + d[None, :]
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + addr, mask=kv_ok, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)  # m = -inf on the first tile: alpha 0, total and acc are 0
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + addr, mask=kv_ok, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    out = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    tl.store(
        out_ptr + b * out_stride_b + t * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )
