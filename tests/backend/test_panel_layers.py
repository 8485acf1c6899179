"""transformers' layers reading the fused decoder's panels (`panel_layers`): products within
float32's error of float64 products of the weights themselves, rows gathered bit for bit,
for every way `decoder._pack_into` lays weights out (stacked on whole panels, concatenated
across a panel, two interleaved), every weight dtype, few rows and a prompt's blocks of
rows."""

from __future__ import annotations

import copy

import pytest
import torch

from genlm_fast.backend.llm import panel_layers
from genlm_fast.backend.llm.decoder import _pack_into, _panel_shape
from genlm_fast.backend.llm.panel_layers import PanelSlice, panel_product, panel_rows
from genlm_fast.ops import extension

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (weights' output features, interleaved): whole panels stacked; a concatenation whose
# parts straddle panels (72 + 40 + 40: q|k|v-like); gate|up interleaved, one ragged panel each
LAYOUTS = [([32, 16], False), ([72, 40, 40], False), ([70, 70], True), ([1], False)]


@pytest.fixture(scope="module")
def module():
    m = extension.load_module()
    assert m is not None and hasattr(m, "linear_small_batch"), "genlm_fast._C is not built"
    return m


def packed(module, sizes, interleave, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, k, generator=g).to(dtype) for n in sizes]
    store = torch.zeros(_panel_shape(weights, interleave), dtype=dtype)
    return weights, _pack_into(module, store, weights, interleave=interleave)


def bound(x, w):
    """float32's error of a product of K terms, relative to the sum of their magnitudes."""
    return 4e-7 * x.shape[-1] * (x.double().abs() @ w.double().abs().T) + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes,interleave", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 5, 25, 64, 65, 130])  # (ROW_BLOCK: 64)
def test_products_are_the_weights_products(module, dtype, sizes, interleave, rows):
    assert panel_layers.ROW_BLOCK == 64  # the rows above straddle its blocks
    k = 34
    weights, slices = packed(module, sizes, interleave, k, dtype)
    x = torch.randn(rows, k).to(dtype)  # a 16-bit model's activations widen first
    for w, where in zip(weights, slices):
        b = torch.randn(w.shape[0]).to(dtype)
        got = panel_product(x, where, b)
        want = x.double() @ w.double().T + b.double()
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert ((got.double() - want).abs() <= bound(x, w)).all()


def test_products_keep_leading_dimensions_and_cut_prompts_into_blocks(module, monkeypatch):
    """A [batch, positions, K] input, and a prompt of several blocks of rows, the last one
    ragged (the block made small for the test)."""
    monkeypatch.setattr(panel_layers, "ROW_BLOCK", 7)
    weights, slices = packed(module, [72, 40, 40], False, 64, torch.bfloat16)
    x = torch.randn(2, 90, 64)
    for w, where in zip(weights, slices):
        got = panel_product(x, where, None)
        want = x.double() @ w.double().T
        assert got.shape == (2, 90, w.shape[0])
        assert ((got.double() - want).abs() <= bound(x, w)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes,interleave", LAYOUTS)
def test_rows_are_the_weights_rows(module, dtype, sizes, interleave):
    weights, slices = packed(module, sizes, interleave, 34, dtype)
    for w, where in zip(weights, slices):
        n = w.shape[0]
        ids = torch.tensor([[0, n - 1, n // 2], [n - 1, n - 1, 0]])  # duplicates, both ends
        got = panel_rows(ids, where)
        assert got.dtype == dtype and torch.equal(got, w[ids])
        with pytest.raises(IndexError, match="out of range"):
            panel_rows(torch.tensor([n]), where)
        with pytest.raises(IndexError, match="out of range"):
            panel_rows(torch.tensor([-1]), where)
        assert panel_rows(torch.zeros(0, dtype=torch.long), where).shape == (0, 34)


def test_a_slice_must_cover_its_features(module):
    _, slices = packed(module, [40], False, 8, torch.float32)
    with pytest.raises(ValueError, match="do not hold features"):
        PanelSlice(slices[0].panels, 0, 100)
    with pytest.raises(ValueError, match="16-wide panels"):
        PanelSlice(slices[0].panels, 16, 8)


def _tiny(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 40))
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_read_their_panels_and_copies_read_their_own_weights(module, dtype):
    model = _tiny(dtype)
    embed, linear = model[0], model[1]
    store = torch.zeros(_panel_shape([linear.weight], False), dtype=dtype)
    (where,) = _pack_into(module, store, [linear.weight])
    estore = torch.zeros(_panel_shape([embed.weight], False), dtype=dtype)
    (ewhere,) = _pack_into(module, estore, [embed.weight])
    panel_layers.read_panels([(linear, where), (embed, ewhere)])
    try:
        assert panel_layers.reads_panels(linear) and panel_layers.reads_panels(embed)
        ids = torch.tensor([[3, 49, 3]])
        with torch.no_grad():
            rows = embed(ids)
            out = linear(rows)
        assert rows.dtype == dtype and torch.equal(rows, embed.weight[ids])
        want = rows.double() @ linear.weight.double().T + linear.bias.double()
        assert ((out.double() - want).abs() <= bound(rows, linear.weight)).all()
        # what the panels answer is the packed weights': zeroing the panels shows which
        store.zero_()
        with torch.no_grad():
            assert (linear(rows) - linear.bias.float()).abs().max() == 0
        # a copy computes from its own weights; gradients come from the weights too
        twin = copy.deepcopy(model)
        with torch.no_grad():
            assert torch.allclose(twin[1](rows).float(), want.float(), rtol=1e-2, atol=1e-2)
        x = rows.float().detach().requires_grad_()
        linear.float()(x).sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0
    finally:
        panel_layers.read_own_weights(model)
    assert not panel_layers.reads_panels(linear) and not panel_layers.reads_panels(embed)
