"""Focused tests of the Triton trie kernels (``genlm_fast.kernels.trie_reduce`` through
``genlm_fast.ops.triton_backend``) against the float64 plain-torch reference, under the
Triton CPU interpreter. Small shapes: the interpreter is ~100x slower than torch.

Covers both trie modes, all three reductions, both tile-kernel paths (the TF32-split mask
product and the dense one), the product path's exact fallback (logits spanning hundreds of
nats, -inf subtrees, infinite weights), spanning nodes, V=1, rows wider than the vocabulary,
several row blocks, fp16/bf16/fp64 inputs, and the product under emulated TF32 truncation.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import triton  # noqa: F401  (TRITON_INTERPRET is set by conftest.py when there is no GPU)

from genlm_fast.ops import trie_reduce
from genlm_fast.ops.layout import TILE
from tests.layouts import make_layout, random_words
from tests.ops.devices import device_for

# the interpreter's numpy evaluates both sides of guarded selects (-inf - -inf, log(0), ...)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

MODES = ["without_eos", "with_eos"]
REDUCTIONS = ["sum", "max", "log_mass"]


# --------------------------------------------------------------------------- helpers


_LAYOUTS = {}


def layout_named(name):
    """Small layouts, built once per module run."""
    if name not in _LAYOUTS:
        rng = np.random.default_rng(1234)
        if name == "one":
            _LAYOUTS[name] = make_layout([b"a"], eos_positions=[0])
        elif name == "seven":
            _LAYOUTS[name] = make_layout(
                [b"ab", b"a", b"", b"abc", b"b", b"ab", b"ba"], eos_positions=[2, 4]
            )
        elif name == "random":  # a few hundred tokens: tiles, spanning nodes, pieces
            words = random_words(rng, 260)
            eos = rng.choice(len(words), size=5, replace=False)
            _LAYOUTS[name] = make_layout(words, eos_positions=eos)
        elif name == "wide":
            # 1,100 tokens (and random_words' chain): the root spans > 16 whole tiles, its
            # four children 3 or 4 each, and 26-way branching below them keeps the spanning
            # nodes few (every one of them is a program of its own when all are wide)
            words = [
                bytes([rng.choice(list(b"abcd"))])
                + bytes(rng.integers(97, 123, size=rng.integers(0, 3)))
                for _ in range(1100)
            ]
            _LAYOUTS[name] = make_layout(words + [b"ab" * k for k in range(1, 25)])
        elif name == "permuted":  # token columns a permutation of a wider row
            words = random_words(rng, 150, alphabet=b"xyz", max_len=9)
            cols = rng.permutation(len(words) + 40)[: len(words)]
            _LAYOUTS[name] = make_layout(words, eos_positions=[0, 3], token_column=cols)
        else:
            raise KeyError(name)
    return _LAYOUTS[name]


DEVICE = device_for("triton")  # cpu: the Triton interpreter


def run_triton(x, layout, reduction, mode):
    got, backend = trie_reduce(x.to(DEVICE), layout, reduction, mode, backend="triton")
    assert backend == "triton"
    return got.cpu()


def run_both(x, layout, reduction, mode):
    got = run_triton(x, layout, reduction, mode)
    want, _ = trie_reduce(x.double(), layout, reduction, mode, backend="reference")
    return got, want


def _max(t):
    return float(t.max()) if t.numel() else 0.0


def assert_matches(got, want, reduction, in_dtype=torch.float32):
    """Tolerances of the task: sum rel 1e-5 (mass >= 1e-30), log_mass abs 1e-4 (>= -80,
    rel 1e-5 below), max exact, -inf exactly where the reference has -inf, never NaN."""
    expect_dtype = (
        torch.float64 if (in_dtype == torch.float64 and reduction != "log_mass") else torch.float32
    )
    assert got.dtype == expect_dtype
    assert got.shape == want.shape
    g = got.double()
    assert not torch.isnan(g).any(), "NaN in the output"
    assert torch.equal(torch.isinf(g) & (g < 0), torch.isinf(want) & (want < 0)), (
        "-inf pattern differs from the reference"
    )
    assert torch.equal(torch.isinf(g) & (g > 0), torch.isinf(want) & (want > 0))
    fin = torch.isfinite(want)
    if reduction == "sum":
        big = fin & (want.abs() >= 1e-30)
        rel = (g - want).abs() / want.abs().clamp_min(1e-300)
        tol = 1e-12 if expect_dtype == torch.float64 else 1e-5
        assert _max(rel[big]) <= tol, _max(rel[big])
        small = fin & ~big
        assert _max((g - want).abs()[small]) <= 1e-30
    elif reduction == "max":
        assert torch.equal(g[fin], want.to(expect_dtype).double()[fin])
    else:
        hi = fin & (want >= -80)
        err = (g - want).abs()
        assert _max(err[hi]) <= 1e-4, _max(err[hi])
        lo = fin & (want < -80)
        assert _max((err / want.abs())[lo]) <= 1e-5


def rows_for(rng, B, C, reduction, spread=3.0):
    if reduction == "sum":
        x = rng.random((B, C)) ** 8  # masses over many orders of magnitude
        x[rng.random((B, C)) < 0.1] = 0.0
    elif reduction == "max":
        x = rng.standard_normal((B, C)) * 5
    else:
        x = rng.standard_normal((B, C)) * spread
    return torch.from_numpy(x.astype(np.float32))


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_spanning_nodes_narrow_and_wide(reduction):
    """The span kernel's two kinds of programs, SPAN_BLOCK narrow nodes each and one wide
    node each (WIDE_TB tiles per step), on a trie whose top levels cover more than
    SPAN_NARROW_TILES whole tiles: every split of the spanning nodes between them (all
    narrow, all wide, the layout's own) gives the reference's values."""
    from genlm_fast.ops import triton_backend
    from genlm_fast.ops.layout import SPAN_NARROW_TILES, span_class_end

    layout = layout_named("wide")
    ml = layout.modes["without_eos"]
    counts = ml.span_tile_hi - ml.span_tile_lo
    narrow = span_class_end(ml, SPAN_NARROW_TILES)
    assert 0 < narrow < len(counts) and counts.max() > SPAN_NARROW_TILES
    # narrow nodes with whole tiles and with left and right pieces
    assert (counts[:narrow] > 1).any() and (ml.span_left[:narrow] >= 0).any()
    assert (ml.span_right[:narrow] >= 0).any()
    rng = np.random.default_rng(8)
    x = rows_for(rng, 2, layout.num_columns, reduction, spread=30.0)
    if reduction != "sum":
        x[1, 100:900] = float("-inf")  # whole tiles without mass
        x[1, 0] = 0.0
    want, _ = trie_reduce(x.double(), layout, reduction, backend="reference")
    arrays = layout.device_arrays("without_eos", DEVICE, "triton")
    assert arrays["span_narrow"] == narrow
    for split in sorted({0, narrow // 2, narrow, len(counts)}):
        got, _ = triton_backend.trie_reduce(
            x.to(DEVICE),
            {**arrays, "span_narrow": split},
            reduction,
            num_nodes=layout.num_nodes,
            num_scratch=ml.num_scratch,
            tile=ml.tile,
        )
        assert_matches(got.cpu(), want, reduction)


def test_random_layout_has_spanning_nodes():
    """The shapes below must actually exercise tiles, pieces and spanning nodes."""
    for mode in MODES:
        ml = layout_named("random").modes[mode]
        assert len(ml.leaf_token) > 4 * TILE
        assert len(ml.span_node) > 10 and (ml.span_tile_hi - ml.span_tile_lo).max() >= 3
        assert (ml.span_left >= 0).any() and (ml.span_right >= 0).any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", ["one", "seven", "random", "permuted"])
def test_matches_reference(name, reduction, mode):
    layout = layout_named(name)
    rng = np.random.default_rng(zlib.crc32(f"{name}/{reduction}/{mode}".encode()))
    B = 3
    C = layout.num_columns + 5  # rows wider than the vocabulary
    x = rows_for(rng, B, C, reduction)
    got, want = run_both(x, layout, reduction, mode)
    assert_matches(got, want, reduction)


@pytest.mark.parametrize("mode", MODES)
def test_log_mass_hundreds_of_nats_and_neg_inf(mode):
    """Forces the product path's exact fallback: ranges far below their tile's max,
    -inf logits, whole -inf subtrees; the normaliser includes columns past the vocabulary."""
    layout = layout_named("random")
    rng = np.random.default_rng(5)
    B, C = 4, layout.num_columns + 9
    x = rng.standard_normal((B, C)) * 60.0  # spans ~400 nats
    x[rng.random((B, C)) < 0.2] = -np.inf
    x[:, -1] = 40.0  # a big logit outside the vocabulary
    # a whole subtree of -inf: every token starting with b"ab" in row 1
    words = random_words(np.random.default_rng(1234), 260)
    for i, w in enumerate(words):
        if w.startswith(b"ab"):
            x[1, i] = -np.inf
    x[2] = rng.standard_normal(C) * 150.0  # ~1000 nats
    x = torch.from_numpy(x.astype(np.float32))
    got, want = run_both(x, layout, "log_mass", mode)
    assert torch.isinf(want[1]).sum() > 5  # the -inf subtree is there
    assert_matches(got, want, "log_mass")


@pytest.mark.parametrize("mode", MODES)
def test_log_mass_neg_inf_mask(mode):
    """A -inf mask over narrow logits (the grammar-constraint case): all -inf ranges must
    come out -inf exactly, finite ones exact."""
    layout = layout_named("random")
    rng = np.random.default_rng(13)
    x = rows_for(rng, 3, layout.num_columns + 3, "log_mass", spread=2.0)
    x[rng.random(x.shape) < 0.7] = float("-inf")
    x[:, -1] = 0.0
    got, want = run_both(x, layout, "log_mass", mode)
    assert torch.isinf(want).sum() > 20
    assert_matches(got, want, "log_mass")


def force_dense(monkeypatch):
    """Every reduction through the dense tile kernel (float64 sum's path): the other paths'
    cases then check it too."""
    from genlm_fast.ops import triton_backend

    monkeypatch.setattr(triton_backend, "tile_kernel", lambda reduction, dtype: "dense")


@pytest.mark.parametrize("path", ["dot", "dense"])
def test_log_mass_spanning_node_of_whole_tiles_far_below_the_max(monkeypatch, path):
    """A spanning node made of whole tiles only (no left or right piece) whose log-mass is
    hundreds of nats below the row's max: the spanning kernel's online log-sum-exp starts
    from an empty (-inf) pair and must not rescale it by exp(+hundreds) (0 * inf = NaN)."""
    if path == "dense":
        force_dense(monkeypatch)
    # leaf order: the TILE tokens under b"a" fill tile 0, the 2 * TILE under b"b" tiles 1-2
    words = [b"a" + bytes([i]) for i in range(TILE)] + [b"b" + bytes([i]) for i in range(2 * TILE)]
    layout = make_layout(words, eos_positions=[0])
    b_node = layout.parent[layout.leaf_node[TILE]]
    while layout.parent[b_node] != layout.root:
        b_node = layout.parent[b_node]
    ml = layout.modes["without_eos"]
    k = list(ml.span_node).index(b_node)  # b"b" spans whole tiles, no pieces
    assert (
        ml.span_left[k] == -1
        and ml.span_right[k] == -1
        and ml.span_tile_hi[k] - ml.span_tile_lo[k] == 2
    )
    x = torch.zeros(2, len(words))
    x[:, TILE:] = torch.linspace(-300.0, -200.0, 2 * TILE)
    x[1, TILE:] -= 300.0
    got, want = run_both(x, layout, "log_mass", "without_eos")
    assert -600 < want[0, b_node] < -150 and -900 < want[1, b_node] < -450
    assert_matches(got, want, "log_mass")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_log_mass_low_and_high_precision_logits(dtype):
    layout = layout_named("random")
    rng = np.random.default_rng(11)
    x = rows_for(rng, 2, layout.num_columns, "log_mass", spread=4.0).to(dtype)
    x[0, 3] = float("-inf")
    got, want = run_both(x, layout, "log_mass", "with_eos")
    assert_matches(got, want, "log_mass", in_dtype=dtype)


@pytest.mark.parametrize("path", ["dot", "dense"])
@pytest.mark.parametrize(
    "dtype,offset", [(torch.float32, 6000.0), (torch.float32, 20000.0), (torch.float16, 60000.0)]
)
def test_log_mass_large_logit_offset(monkeypatch, path, dtype, offset):
    """Logits with a big common offset (logits / a small temperature; fp16 logits near the
    top of their range): the row normaliser is ~offset, and rounding it to one float32
    would put half an ulp of it (2.4e-4 at 6000) into every node. The kernels keep it as
    (row max, log-sum) and must meet the 1e-4 bound whatever the offset."""
    if path == "dense":
        force_dense(monkeypatch)
    layout = layout_named("random")
    rng = np.random.default_rng(int(offset) + (path == "dense"))
    x = (rows_for(rng, 2, layout.num_columns + 3, "log_mass", spread=2.0) + offset).to(dtype)
    got, want = run_both(x, layout, "log_mass", "with_eos")
    assert (torch.isfinite(want) & (want >= -80)).sum() > 20
    assert_matches(got, want, "log_mass", in_dtype=dtype)


@pytest.mark.parametrize("reduction", ["sum", "max"])
def test_float64_weights(reduction):
    layout = layout_named("random")
    rng = np.random.default_rng(3)
    x = rows_for(rng, 2, layout.num_columns, reduction).double()
    got, want = run_both(x, layout, reduction, "without_eos")
    assert_matches(got, want, reduction, in_dtype=torch.float64)


def test_max_with_neg_inf_weights():
    """max over a non-empty all -inf range is -inf; only an empty node gives 0."""
    layout = layout_named("random")
    rng = np.random.default_rng(8)
    x = rows_for(rng, 2, layout.num_columns, "max")
    x[rng.random(x.shape) < 0.5] = float("-inf")
    x[1] = float("-inf")  # every node -inf (the EOS node has no leaf in without_eos: 0)
    for mode in MODES:
        got, want = run_both(x, layout, "max", mode)
        assert_matches(got, want, "max")
        assert (want[1] == float("-inf")).sum() > 0


def test_sum_with_infinite_weight_takes_exact_path():
    layout = layout_named("random")
    rng = np.random.default_rng(9)
    x = rows_for(rng, 3, layout.num_columns, "sum")
    x[1, 17] = float("inf")
    got, want = run_both(x, layout, "sum", "without_eos")
    assert torch.isinf(want[1]).any()
    assert_matches(got, want, "sum")


def test_many_row_blocks():
    """B larger than one program's row block (16) and not a multiple of it."""
    layout = layout_named("seven")
    rng = np.random.default_rng(4)
    for reduction in ("log_mass", "sum"):
        x = rows_for(rng, 70, layout.num_columns + 2, reduction)
        got, want = run_both(x, layout, reduction, "with_eos")
        assert_matches(got, want, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_rows_launched_in_chunks(monkeypatch, reduction):
    """More rows than a grid axis takes (CUDA: 65535) go in row chunks; with the chunk cut to
    3 rows, 7 rows take three launches, each writing its own slice of the output."""
    from genlm_fast.ops import triton_backend

    monkeypatch.setattr(triton_backend, "MAX_GRID_ROWS", 3)
    layout = layout_named("random")
    rng = np.random.default_rng(11)
    x = rows_for(rng, 7, layout.num_columns, reduction, spread=30.0)
    got, want = run_both(x, layout, reduction, "with_eos")
    assert_matches(got, want, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_dense_path(monkeypatch, reduction):
    """The dense tile kernel (float64 sum's) on every reduction."""
    force_dense(monkeypatch)
    layout = layout_named("random")
    rng = np.random.default_rng(6)
    x = rows_for(rng, 2, layout.num_columns + 1, reduction, spread=60.0)
    if reduction == "log_mass":
        x[0, :40] = float("-inf")
    for mode in MODES:
        got, want = run_both(x, layout, reduction, mode)
        assert_matches(got, want, reduction)


@pytest.mark.skipif(
    DEVICE == "cuda",
    reason="emulates TF32 inside the CPU interpreter; on a "
    "GPU the real tensor cores run the other tests",
)
@pytest.mark.parametrize("reduction", ["sum", "log_mass"])
def test_product_under_tf32_truncation(monkeypatch, reduction):
    """The interpreter's tl.dot is exact fp32; GPUs may truncate fp32 operands to TF32.
    Emulate that truncation: the hi/lo split must keep the task's tolerances."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    calls = []

    def truncate(handle):
        data = handle.data
        if data.dtype == np.float32:
            data = (data.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
        return interpreter.TensorHandle(data, handle.dtype.scalar)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        calls.append(1)
        return original(self, truncate(a), truncate(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    layout = layout_named("random")
    rng = np.random.default_rng(10)
    x = rows_for(rng, 3, layout.num_columns, reduction, spread=5.0)
    got, want = run_both(x, layout, reduction, "without_eos")
    assert calls, "the product path did not run"
    assert_matches(got, want, reduction)


def test_root_mass_over_whole_vocabulary():
    """log_mass of the root is 0 when the vocabulary is the whole row; sum of the root is
    the row total (accumulated across tiles in float64)."""
    layout = layout_named("random")
    rng = np.random.default_rng(12)
    C = layout.num_columns
    x = rows_for(rng, 2, C, "log_mass", spread=8.0)
    got = run_triton(x, layout, "log_mass", "without_eos")
    assert torch.allclose(got[:, layout.root], torch.zeros(2), atol=1e-5)
    w = rows_for(rng, 2, C, "sum")
    got = run_triton(w, layout, "sum", "with_eos")
    total = w.double().sum(1)
    assert torch.allclose(got[:, layout.root].double(), total, rtol=1e-6)
