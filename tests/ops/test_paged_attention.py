"""``paged_attention`` on every backend against a float64 attention written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from genlm_fast.ops.paged_attention import BACKENDS, PagedQuery, paged_attention
from tests.ops.devices import device_for


def oracle(query, k_pool, v_pool, tables, positions, page, window, scale):
    """Float64, one query head and token at a time: the row's visible positions looked up
    through its block table one by one."""
    B, heads, T, D = query.shape
    group = heads // k_pool.shape[1]
    out = torch.zeros((B, T, heads, D), dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            pos = int(positions[b, t])
            lo = 0 if window is None else max(0, pos + 1 - window)
            seen = range(lo, pos + 1)
            if not seen:
                continue
            slots = [int(tables[b, n // page]) * page + n % page for n in seen]
            for h in range(heads):
                q = query[b, h, t].double()
                keys = k_pool[slots, h // group].double()
                values = v_pool[slots, h // group].double()
                w = torch.softmax(keys @ q * scale, dim=0)
                out[b, t, h] = w @ values
    return out


def make_pool(blocks, page, kv_heads, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks * page, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(blocks * page, kv_heads, D, generator=g).to(dtype)
    return k, v


def run(backend, query, k, v, where, scale):
    device = device_for(backend)
    on = PagedQuery(
        where.block_tables.to(device), where.positions.to(device), where.page, where.window
    )
    out = paged_attention(query.to(device), k.to(device), v.to(device), on, scale, backend)
    assert out.dtype == query.dtype and out.shape == (
        query.shape[0],
        query.shape[2],
        query.shape[1],
        query.shape[3],
    )
    return out.cpu()


def check(backend, query, k, v, where, atol):
    scale = 1 / math.sqrt(query.shape[-1])
    got = run(backend, query, k, v, where, scale)
    want = oracle(query, k, v, where.block_tables, where.positions, where.page, where.window, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "D", "page"),
    [(6, 2, 24, 4), (4, 4, 16, 1), (3, 1, 64, 5), (9, 3, 64, 16)],
)
def test_decoding_rows_of_ragged_lengths(backend, heads, kv_heads, D, page):
    """One new token a row over pasts of 1 position, a block boundary, less than a block and
    several blocks; GQA with groups of 3 (not a power of two), MHA and MQA."""
    B, blocks = 5, 24
    k, v = make_pool(blocks, page, kv_heads, D, torch.float32, seed=heads * page)
    g = torch.Generator().manual_seed(D)
    lengths = [1, page, page + 1, 3, 2 * page + 3]
    width = max(-(-n // page) for n in lengths) + 1
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(B)])
    positions = torch.tensor(lengths)[:, None] - 1
    query = torch.randn(B, heads, 1, D, generator=g)
    check(backend, query, k, v, PagedQuery(tables.int(), positions.int(), page), atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_sharing_blocks_and_a_prefill(backend):
    """Two rows read the same prompt blocks (a shared prefix) and part of one more; a third
    row runs a 5-token prefill, each token seeing the tokens before it only, beside padding
    (-1: output 0)."""
    page, kv_heads, heads, D = 4, 2, 4, 32
    k, v = make_pool(10, page, kv_heads, D, torch.float32, seed=7)
    tables = torch.tensor([[3, 7, 1, 0], [3, 7, 5, 0], [9, 2, 0, 0]], dtype=torch.int64)
    positions = torch.tensor([[-1, -1, -1, -1, 9], [-1, -1, -1, -1, 10], [2, 3, 4, 5, 6]])
    query = torch.randn(3, heads, 5, D, generator=torch.Generator().manual_seed(1))
    where = PagedQuery(tables, positions, page)
    check(backend, query, k, v, where, atol=2e-6)
    out = run(backend, query, k, v, where, 0.2)
    assert (out[:2, :4] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 3, 100])
def test_sliding_window(backend, window):
    page, D = 4, 16
    k, v = make_pool(8, page, 1, D, torch.float32, seed=window)
    tables = torch.tensor([[5, 1, 6, 2, 0], [4, 3, 7, 0, 0]])
    positions = torch.tensor([[17, 18], [0, 9]])
    query = torch.randn(2, 2, 2, D, generator=torch.Generator().manual_seed(2))
    check(backend, query, k, v, PagedQuery(tables, positions, page, window), atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_pool_and_query(backend, dtype):
    """A 16-bit model's states: widened exactly, products and softmax in float32; the result
    rounded once to the query's dtype."""
    page, D = 8, 64
    k, v = make_pool(6, page, 2, D, dtype, seed=3)
    tables = torch.tensor([[1, 4, 2], [0, 5, 3]])
    positions = torch.tensor([[20], [7]])
    query = torch.randn(2, 4, 1, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    eps = torch.finfo(dtype).eps
    check(backend, query, k, v, PagedQuery(tables, positions, page), atol=4 * eps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_slots_never_reach_the_result(backend):
    """NaN and inf in every slot a row does not see (free blocks, other rows' blocks, the
    rest of a partly filled block) change nothing."""
    page, D = 4, 16
    k, v = make_pool(6, page, 1, D, torch.float32, seed=5)
    tables = torch.tensor([[2, 4, 0]])
    positions = torch.tensor([[5]])
    seen = [2 * page + i for i in range(page)] + [4 * page, 4 * page + 1]
    dirty_k, dirty_v = k.clone(), v.clone()
    unseen = torch.ones(k.shape[0], dtype=torch.bool)
    unseen[seen] = False
    dirty_k[unseen] = float("nan")
    dirty_v[unseen] = float("inf")
    query = torch.randn(1, 2, 1, D, generator=torch.Generator().manual_seed(6))
    where = PagedQuery(tables, positions, page)
    clean = run(backend, query, k, v, where, 0.25)
    assert torch.equal(run(backend, query, dirty_k, dirty_v, where, 0.25), clean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_row_over_many_blocks(backend):
    """A past of 300 positions in blocks of 16 (a walk of ten 32-position tiles, the last
    one partial), keys scaled so that a few positions dominate the softmax."""
    page, D = 16, 32
    k, v = make_pool(24, page, 1, D, torch.float32, seed=8)
    k *= 3
    g = torch.Generator().manual_seed(9)
    tables = torch.randperm(24, generator=g)[:19][None]
    query = torch.randn(1, 2, 1, D, generator=g)
    check(backend, query, k, v, PagedQuery(tables, torch.tensor([[299]]), page), atol=5e-6)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: a.update(query=a["query"][0]), ValueError, "query must be"),
        (lambda a: a.update(query=a["query"].long()), TypeError, "query must be a float"),
        (lambda a: a.update(k_pool=a["k_pool"][:, :1]), ValueError, "k_pool and v_pool"),
        (lambda a: a.update(k_pool=a["k_pool"].half()), TypeError, "k_pool is"),
        (lambda a: a.update(query=a["query"][:, :3]), ValueError, "cannot share"),
        (lambda a: a.update(positions=a["positions"].float()), TypeError, "positions must"),
        (lambda a: a.update(positions=a["positions"][:, :1]), ValueError, "do not match"),
        (lambda a: a.update(page=3), ValueError, "page must"),
        (lambda a: a.update(window=0), ValueError, "window must"),
        (lambda a: a.update(positions=a["positions"] + 40), IndexError, "past what"),
        (lambda a: a.update(query=a["query"].to("meta")), ValueError, "on cpu but the query"),
    ],
)
def test_bad_input_is_named(change, error, match):
    args = {
        "query": torch.zeros(1, 4, 2, 8),
        "k_pool": torch.zeros(16, 2, 8),
        "v_pool": torch.zeros(16, 2, 8),
        "positions": torch.tensor([[0, 1]]),
        "page": 4,
        "window": None,
    }
    change(args)
    where = PagedQuery(
        torch.zeros(1, 2, dtype=torch.int64), args["positions"], args["page"], args["window"]
    )
    with pytest.raises(error, match=match):
        paged_attention(args["query"], args["k_pool"], args["v_pool"], where, 1.0, "reference")


def test_unknown_backend():
    where = PagedQuery(
        torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64), 1
    )
    with pytest.raises(ValueError, match="unknown paged_attention backend"):
        paged_attention(
            torch.zeros(1, 1, 1, 8), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), where, 1.0, "numba"
        )
