"""``log_softmax_rows`` (the engine-side capture op) on every backend vs a float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genlm_fast.ops.log_softmax import BACKENDS, log_softmax_rows
from tests.ops.devices import device_for


def oracle(logits, src):
    x = logits.double()[list(src)]
    return x - torch.logsumexp(x, dim=-1, keepdim=True)


def run(backend, logits, src, dst, slots):
    """``log_softmax_rows`` on the backend's device (Triton: the GPU when there is one, else
    its CPU interpreter); the result back on the CPU."""
    device = device_for(backend)
    out = torch.full((slots, logits.shape[1]), 7.0, device=device)
    used = log_softmax_rows(logits.to(device), src, dst, out, backend=backend)
    assert used == backend
    return out.cpu()


def check(out, logits, src, dst):
    want = oracle(logits, src)
    got = out[list(dst)].double()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    assert not torch.isnan(got).any()
    # float32 output: |x - lse| rounded once, plus the float32 normaliser
    torch.testing.assert_close(got[finite], want[finite], rtol=2e-6, atol=5e-6)
    untouched = sorted(set(range(out.shape[0])) - set(dst))
    assert (out[untouched] == 7.0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("V", [1, 7, 1031, 2048])
def test_selected_rows_into_slots(backend, V):
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(5, V, generator=g) * 8
    src, dst = [4, 0, 2], [1, 5, 3]
    check(run(backend, logits, src, dst, 6), logits, src, dst)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_vocabulary_row(backend):
    V = 128_256 + 7  # Llama-3 width, not a multiple of the block
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3)) * 4
    logits[1, 12345] = 300.0  # one token holds all the mass
    check(run(backend, logits, [1, 0], [0, 1], 2), logits, [1, 0], [0, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_sources_neg_inf_and_hundreds_of_nats(backend):
    V = 300
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    logits[0, ::3] = float("-inf")  # masked tokens
    logits[1, :150] -= 500.0  # half the row hundreds of nats down
    logits[2, :] = float("-inf")
    logits[2, 17] = 0.0  # a single possible token: log-prob 0, the rest -inf
    src, dst = [0, 0, 1, 2], [3, 0, 2, 1]  # row 0 captured twice
    check(run(backend, logits, src, dst, 4), logits, src, dst)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(backend, dtype):
    logits = (torch.randn(3, 999, generator=torch.Generator().manual_seed(2)) * 5).to(dtype)
    check(run(backend, logits, [2, 1], [0, 1], 2), logits, [2, 1], [0, 1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,offset",
    [
        (torch.float32, 5000.0),
        (torch.float32, 60000.0),
        (torch.float16, 5000.0),
        (torch.float16, 60000.0),
    ],
)
def test_large_logit_offset(backend, dtype, offset):
    """A big common offset (a small temperature; fp16 logits near their top): lse ~ offset
    must not be rounded to one float32 (half an ulp of 60000 is 2e-3)."""
    g = torch.Generator().manual_seed(int(offset))
    logits = (torch.randn(3, 300, generator=g) * 3 + offset).to(dtype)
    check(run(backend, logits, [2, 0], [1, 0], 2), logits, [2, 0], [1, 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_selection_writes_nothing(backend):
    out = run(backend, torch.randn(2, 10), [], [], 3)
    assert (out == 7.0).all()


def test_bad_input():
    x, out = torch.randn(3, 10), torch.zeros(4, 10)
    with pytest.raises(ValueError, match="2-D"):
        log_softmax_rows(x[0], [0], [0], out)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        log_softmax_rows(x.long(), [0], [0], out)
    with pytest.raises(ValueError, match="float32"):
        log_softmax_rows(x, [0], [0], out.double())
    with pytest.raises(ValueError, match="entries"):
        log_softmax_rows(x, [0], [0], torch.zeros(4, 11))
    with pytest.raises(ValueError, match="destination"):
        log_softmax_rows(x, [0, 1], [0], out)
    with pytest.raises(IndexError, match="source rows"):
        log_softmax_rows(x, [3], [0], out)
    with pytest.raises(IndexError, match="destination rows"):
        log_softmax_rows(x, [0], [4], out)
    with pytest.raises(ValueError, match="distinct"):
        log_softmax_rows(x, [0, 1], [2, 2], out)
    with pytest.raises(ValueError, match="unknown"):
        log_softmax_rows(x, [0], [0], out, backend="cuda")
    assert np.all(out.numpy() == 0)  # nothing written by a rejected call


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["transposed", "column-slice"])
def test_strided_output_buffer(backend, layout):
    """An ``out`` whose rows are not unit-stride is written through a contiguous stand-in."""
    V, slots = 37, 4
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 6
    device = device_for(backend)
    base = (
        torch.full((V, slots), 7.0, device=device)
        if layout == "transposed"
        else torch.full((slots, 2 * V), 7.0, device=device)
    )
    out = base.t() if layout == "transposed" else base[:, ::2]
    assert out.stride(1) != 1
    assert log_softmax_rows(logits.to(device), [2, 0], [3, 1], out, backend=backend) == backend
    check(out.cpu(), logits, [2, 0], [3, 1])
