"""The CUDA trie kernels (csrc/trie_reduce_cuda.cu), RUN on the CPU under the emulator of
tests/ops/cuda_emulator.py (how it emulates a launch: its docstring). Over 500 lines so that
every test shares one emulator build per process (a module fixture; the suite's workers take
whole files, so a second file would build it again).

The results are compared with the plain-torch reference backend on random tries
(duplicates, empty tokens, deep chains, EOS mode, rows wider than the vocabulary, -inf
logits, hundreds of nats, fp16/bf16 logits) and with the row chunking of ``launch``
(gridDim.y <= 65535) forced down to 2 rows. What it cannot show: the device's own
arithmetic (CUDA's exp/log are within 1-2 ulp of glibc's), memory-model races between
blocks (blocks run one after another), timing, and csrc/trie_reduce_cuda_op.cpp (torch + CUDA).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genlm_fast.ops import dispatch
from genlm_fast.ops import layout as layout_module
from genlm_fast.ops.layout import SPAN_NARROW_TILES, SPAN_WARP_TILES, span_class_end
from tests.ops.cuda_emulator import (
    CU,
    REDUCTION,
    SHARED_IDS,
    STAGE_MIN_ROWS,
    TILE_THREADS,
    assert_matches,
    build_emulator,
    check,
    emulated_source,
    make_trie,
    make_values,
    reference,
    run_emulated,
    staged_and_not,
    use_emulated_binding,
)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(str(tmp_path_factory.mktemp("cuda_emu")))


def test_emulated_source_rewrites_every_cuda_construct():
    with open(CU) as f:
        src = emulated_source(f.read())
    for construct in (
        "<<<",
        ">>>",
        "__syncthreads",
        "__shfl",
        "threadIdx",
        "blockIdx",
        "__shared__",
    ):
        assert construct not in src, construct


@pytest.mark.parametrize("reduction", ["sum", "max", "log_mass"])
def test_random_tries(emulator, tmp_path, reduction):
    """Random vocabularies over a 3-letter alphabet: duplicates, empty tokens, prefixes of
    each other, several tiles and spanning nodes; EOS mode; -inf entries."""
    rng = np.random.default_rng(REDUCTION[reduction])
    for case in range(6):
        n = int(rng.choice([1, 2, 40, 63, 64, 65, 300, 700]))
        words = [bytes(rng.integers(97, 100, size=rng.integers(0, 7))) for _ in range(n)]
        eos = {words[0]} if case % 2 else ()
        check(
            emulator,
            tmp_path,
            words,
            reduction,
            B=int(rng.integers(1, 4)),
            extra=7 if reduction == "log_mass" and case % 3 == 0 else 0,
            eos=eos,
            spread=[1.0, 50.0, 400.0][case % 3],
            neg_inf=0.3 if case >= 3 else 0.0,
            seed=case,
        )


@pytest.mark.parametrize("reduction", ["sum", "max", "log_mass"])
@pytest.mark.parametrize("tile,B", [(2, 3), (8, STAGE_MIN_ROWS), (27, 5)])
def test_layouts_of_smaller_tiles(emulator, tmp_path, monkeypatch, reduction, tile, B):
    """The tile kernel lays out its shared arrays for kMaxTile (64) leaves whatever the
    layout's tile, and maps the layout's source codes (runs from `tile` on, the whole tile at
    2 * tile - 2, none at 2 * tile - 1) onto those rows: layouts of 2, 8 and 27 leaves a
    tile (layout.TILE; the production layout's 64 makes the mapping the identity), staged
    (B=8) and not, EOS mode included."""
    monkeypatch.setattr(layout_module, "TILE", tile)
    rng = np.random.default_rng(tile)
    # several tiles and spanning nodes at every tile size: tiles of 2 need fewer tokens
    # (every tile is a block of 256 OS threads here)
    n = 40 if tile == 2 else 150
    words = [bytes(rng.integers(97, 100, size=rng.integers(0, 6))) for _ in range(n)]
    assert make_trie(words).layout.modes["without_eos"].tile == tile
    check(
        emulator,
        tmp_path,
        words,
        reduction,
        B=B,
        eos={words[1]},
        spread=30.0,
        neg_inf=0.2,
        extra=3 if reduction == "log_mass" else 0,
    )


@pytest.mark.parametrize("reduction", ["sum", "max", "log_mass"])
@pytest.mark.parametrize(
    "shape", ["one_token", "empty_token", "deep_chain", "wide_fanout", "duplicates"]
)
def test_shapes_that_hurt(emulator, tmp_path, reduction, shape):
    words = {
        "one_token": [b"x"],
        "empty_token": [b""],
        "deep_chain": [b"z" * k for k in range(1, 301)],  # a chain through 5 tiles
        "wide_fanout": [bytes([a]) for a in range(256)]
        + [bytes([a, b]) for a in range(0, 256, 5) for b in range(0, 256, 7)],
        "duplicates": [b"ab", b"ab", b"a", b"ab", b"", b"", b"abc", b"b"] * 13,
    }[shape]
    check(
        emulator,
        tmp_path,
        words,
        reduction,
        B=2,
        spread=30.0,
        neg_inf=0.2,
        extra=5 if reduction == "log_mass" else 0,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_log_mass_every_logit_dtype(emulator, tmp_path, dtype):
    rng = np.random.default_rng(4)
    words = [bytes(rng.integers(97, 100, size=rng.integers(1, 6))) for _ in range(200)]
    check(emulator, tmp_path, words, "log_mass", B=2, extra=3, dtype=dtype, spread=8.0)


@pytest.mark.parametrize("reduction", ["sum", "max"])
def test_float64_sum_max_give_float64(emulator, tmp_path, reduction):
    rng = np.random.default_rng(5)
    words = [bytes(rng.integers(97, 100, size=rng.integers(1, 6))) for _ in range(200)]
    check(emulator, tmp_path, words, reduction, B=2, dtype=torch.float64)


def test_log_mass_hundreds_of_nats_and_neg_inf(emulator, tmp_path):
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(200)]
    rows = np.zeros((2, 200))
    rows[0] = np.linspace(0, -900, 200)
    rows[1] = -1000.0
    rows[1, 5] = 0.0
    rows[1, 40:150] = -np.inf  # whole tiles of -inf: -inf partials in the spanning merge
    check(emulator, tmp_path, words, "log_mass", rows=torch.from_numpy(rows).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B", [5, 40])
def test_log_mass_logits_far_from_zero(emulator, tmp_path, dtype, B):
    """Rows around 1e12, 1e19, -1e30 and float32's largest values: the tile kernel forms its
    lse from the (max, log-sum) pair (a2) leaves, so only differences of logits matter; a
    double lse = max + log(sum) would round the log away (1e19: the top tokens' log-mass 0
    instead of -log 2). Blocks of 4 + 1 rows, and staged blocks of 32 + 8."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(150)]
    V = len(words)
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((B, V)) * 4
    rows[0, :] = -np.inf
    rows[0, [3, 100]] = 1e19
    rows[0, 20:40] = 0.0
    rows[1, :] = -1e30
    rows[2] = rng.uniform(-1.6e38, 1.6e38, V)
    rows[3] += 1e12
    x = torch.from_numpy(rows).to(dtype)
    check(emulator, tmp_path, words, "log_mass", rows=x)
    trie = make_trie(words)
    _, _, _, got, _ = run_emulated(emulator, str(tmp_path), x, trie.layout, "log_mass")
    leaves = [trie.word2leaf[(w, i)] for i, w in enumerate(words)]
    np.testing.assert_allclose(got[0, [leaves[3], leaves[100]]], [-np.log(2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(got[1, leaves], -np.log(V), rtol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "max", "log_mass"])
@pytest.mark.parametrize("B", [3, 40])
def test_runs_of_every_length(emulator, tmp_path, reduction, B):
    """The tile kernel's runs (reduce_run): one tile whose runs have every length from 2 to
    62 (the node a^k holds the tokens a^j b, j >= k), in blocks of 4 rows and, staged, of
    32 + 8.
    log_mass rows: the fast path (a sum of exps), the fallback of runs under 1e-24 of the
    tile's mass (every leaf of the a-subtree 100 nats or more under the token b), and runs
    of -inf only."""
    words = [b"b"] + [b"a" * k + b"b" for k in range(1, 63)]
    ml = make_trie(words).layout.modes["without_eos"]
    bounds = ml.run_bounds.astype(np.int64)
    assert len(ml.tile_run_ptr) == 2
    assert sorted(((bounds >> 16) - (bounds & 0xFFFF)).tolist()) == list(range(2, 63))
    rng = np.random.default_rng(7)
    if reduction == "log_mass":
        rows = rng.standard_normal((B, len(words))) * 3
        rows[1] = -100.0 - 3.0 * np.arange(len(words))
        rows[2] = -np.inf
        rows[:, 0] = 0.0
        x = torch.from_numpy(rows).float()
    else:
        x = make_values(rng, B, len(words), reduction, neg_inf=0.2)
    check(emulator, tmp_path, words, reduction, rows=x)


@pytest.mark.parametrize("reduction", ["sum", "max", "log_mass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_long_node_blocks_and_tiles_owning_none(emulator, tmp_path, reduction, dtype):
    """The tile kernel writes the block of node ids a tile owns, a warp per 32 ids: a
    1,500-byte token (a chain of 1,500 single-child nodes over one leaf: one tile owns them
    all, each warp loops; their source is that one leaf), 200 copies of an EOS token (under
    WITH_EOS all deposit on the EOS node, one node over several tiles: tiles that own no
    node at all, only their total goes to scratch), and float64 (double shared arrays)."""
    rng = np.random.default_rng(3)
    words = (
        [b"q" * 1500]
        + [b"dd"] * 200
        + [bytes(rng.integers(97, 100, size=rng.integers(1, 5))) for _ in range(300)]
    )
    modes = make_trie(words, eos=[b"dd"]).layout.modes
    assert np.diff(modes["without_eos"].tile_node_lo).max() > 1500
    assert (np.diff(modes["with_eos"].tile_node_lo) == 0).any()
    check(
        emulator,
        tmp_path,
        words,
        reduction,
        B=3,
        dtype=dtype,
        neg_inf=0.2,
        eos=[b"dd"],
        extra=3 if reduction == "log_mass" else 0,
    )


@pytest.mark.parametrize("reduction", ["sum", "max", "log_mass"])
@pytest.mark.parametrize("B", [3, STAGE_MIN_ROWS])
def test_tiles_past_their_shared_index_slices(emulator, tmp_path, reduction, B):
    """The tile kernel loads a tile's node sources and scratch values into shared arrays of
    SHARED_IDS and TILE_THREADS entries, and reads the rest from global memory: a chain of
    700 nested tokens with a branch at every 11th, where a tile owns more node ids than that
    and holds the pieces of more spanning nodes (from varied sources past the shared ones),
    unstaged (B=3) and staged."""
    words = [b"x" * k for k in range(1, 701)] + [b"x" * k + b"y" for k in range(1, 701, 11)]
    mode = make_trie(words).layout.modes["without_eos"]
    assert np.diff(mode.tile_node_lo).max() > SHARED_IDS
    ptr = mode.tile_scratch_ptr
    t = int(np.argmax(np.diff(ptr)))
    past = mode.scratch_src[ptr[t] + TILE_THREADS : ptr[t + 1]]
    assert len(past) and len(np.unique(past)) > 1
    check(
        emulator,
        tmp_path,
        words,
        reduction,
        B=B,
        spread=3.0,
        extra=2 if reduction == "log_mass" else 0,
    )


@pytest.mark.parametrize("reduction", ["sum", "max", "log_mass"])
def test_spanning_nodes_by_thread_warp_and_block(emulator, tmp_path, reduction):
    """The span kernel's three paths, a thread per (node, row) for the first
    ``span_narrow`` spanning nodes, a warp per (node, row) up to ``span_warp`` and a block
    per (node, row) for the rest, on a trie whose root and top levels cover more than
    SPAN_NARROW_TILES whole tiles (so the layout's own split uses the first two; the block
    path is for nodes over SPAN_WARP_TILES tiles, which a test-sized trie lacks): each
    split, each path alone and all three at once, gives the reference's values. Rows: -inf
    runs over whole tiles, and masses far apart. (Every block node is a block of 256 OS
    threads here: the trie is kept just big enough, the root over 17 tiles and its four
    children over 3 or 4 each, and 26-way branching below them keeps the spanning nodes
    few.)"""
    rng = np.random.default_rng(21)
    words = [
        bytes([rng.choice(list(b"abcd"))]) + bytes(rng.integers(97, 123, size=rng.integers(0, 3)))
        for _ in range(1150)
    ]
    layout = make_trie(words).layout
    ml = layout.modes["without_eos"]
    counts = ml.span_tile_hi - ml.span_tile_lo
    narrow = span_class_end(ml, SPAN_NARROW_TILES)
    S = len(counts)
    assert (np.diff(counts) >= 0).all()  # sorted: the narrow nodes are a prefix
    assert 0 < narrow < S and counts.max() > SPAN_NARROW_TILES
    assert (counts[:narrow] > 1).any()  # narrow nodes over whole tiles, not pieces alone
    assert span_class_end(ml, SPAN_WARP_TILES) == S
    x = make_values(rng, 3, layout.num_columns, reduction, spread=40.0, neg_inf=0.2)
    if reduction != "sum":
        x[1, 200:900] = -np.inf  # whole tiles of -inf
    x[2] *= 1e-3 if reduction == "sum" else 3.0
    want = reference(x, layout, reduction)
    # all by block on one row (-inf tiles; for sum the scaled row), the others on every row
    one = slice(1, 2) if reduction != "sum" else slice(2, 3)
    every = slice(None)
    for (split, warp_end), rows in [
        ((0, 0), one),
        ((0, S), every),
        ((narrow, S), every),
        ((S, S), every),
        ((narrow, narrow), every),
        ((max(narrow - 24, 0), S - 1), every),
    ]:
        status, errors, _, got, _ = run_emulated(
            emulator,
            str(tmp_path),
            x[rows],
            layout,
            reduction,
            span_narrow=split,
            span_warp=warp_end,
        )
        assert status == 0 and errors == 0
        assert_matches(
            got, want[rows], reduction, f"{reduction}, span_narrow={split}, span_warp={warp_end}"
        )
    for split, warp_end in [(S + 1, S + 1), (0, S + 1), (narrow, narrow - 1)]:
        status, _, launches, _, _ = run_emulated(
            emulator,
            str(tmp_path),
            x,
            layout,
            reduction,
            span_narrow=split,
            span_warp=warp_end,
        )
        assert status != 0 and launches == 0  # a split out of order or past S is refused


@pytest.mark.parametrize("reduction", ["sum", "log_mass"])  # max: as sum, one vmax each
def test_spanning_nodes_of_many_chunks(emulator, tmp_path, monkeypatch, reduction):
    """span_reduce loads a member's elements kChunk at a time (a thread 4, a warp's lanes 4
    each) and, for log_mass, merges the chunks' (max, sum of exps) pairs: on tiles of 2
    leaves the root spans over 4 * 32 tiles, so a warp takes several chunks and a thread
    dozens, with whole chunks of -inf between chunks of mass far apart (each merge rescales
    one way or the other, or skips a chunk without mass). Every spanning node by thread,
    then by warp; the 3 widest by block (a block of 256 OS threads each here)."""
    monkeypatch.setattr(layout_module, "TILE", 2)
    rng = np.random.default_rng(5)
    words = [bytes(rng.integers(97, 101, size=rng.integers(1, 6))) for _ in range(290)]
    layout = make_trie(words).layout
    ml = layout.modes["without_eos"]
    S = len(ml.span_node)
    assert (ml.span_tile_hi - ml.span_tile_lo).max() > 4 * 32
    x = make_values(rng, 2, layout.num_columns, reduction, spread=5.0)
    if reduction != "sum":
        leaf_columns = ml.leaf_token  # in leaf order: stretches of whole tiles
        for k, lo in enumerate(range(0, len(leaf_columns), 96)):
            x[0, leaf_columns[lo : lo + 48]] = -np.inf  # 24 tiles without mass
            x[0, leaf_columns[lo + 48 : lo + 96]] += [-300.0, 0.0, 150.0][k % 3]
    want = reference(x, layout, reduction)
    for split, warp_end in [(S, S), (0, S), (0, S - 3)]:
        status, errors, _, got, _ = run_emulated(
            emulator,
            str(tmp_path),
            x,
            layout,
            reduction,
            span_narrow=split,
            span_warp=warp_end,
        )
        assert status == 0 and errors == 0
        assert_matches(
            got, want, reduction, f"{reduction}, span_narrow={split}, span_warp={warp_end}"
        )


@pytest.mark.parametrize("reduction", ["sum", "max", "log_mass"])
def test_rows_are_chunked_below_the_grid_limit(emulator, tmp_path, reduction):
    """``launch`` splits B into chunks of kMaxGridY rows (gridDim.y <= 65535); with the
    chunk lowered to 2, B=5 takes three chunks of every kernel; lowered to 10, B=21 too
    (the first two staged, a block of 8 rows and one of 2; the last not), each row's result
    the reference's. A chunk's kernels: the row pass (staged or not), the lse merge
    (log_mass), the tile kernel and the span pass."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(150)]
    kernels = 4 if reduction == "log_mass" else 3
    launches = check(emulator, tmp_path, words, reduction, B=5, max_grid_y=2)
    assert launches == 3 * kernels
    launches = check(emulator, tmp_path, words, reduction, B=21, max_grid_y=10)
    assert launches == 3 * kernels


@pytest.mark.parametrize("reduction", ["sum", "max", "log_mass"])
@pytest.mark.parametrize("B", [4, 8, 13, 21, 40])
def test_row_blocks_give_each_row_its_own_result(emulator, tmp_path, reduction, B):
    """The tile kernel takes 32 rows per block (16, 8, 4, 2 or 1 for a smaller batch): full
    and partial row blocks of every size but 1 and 2, each row with its own scale: spreads from
    1 to 3000 nats, -1e30 masks and -inf (log_mass: ranges far below their tile's max take the
    exact per-range path in one row while the others add shifted terms)."""
    words = [bytes(np.random.default_rng(i).integers(97, 100, size=1 + i % 6)) for i in range(300)]
    rng = np.random.default_rng(B)
    C = len(words) + (3 if reduction == "log_mass" else 0)
    x = make_values(rng, B, C, reduction).double()
    if reduction != "sum":
        x[1] *= 300.0 if reduction == "log_mass" else 1.0  # a row spanning thousands of nats
        x[2, ::3] = -1e30  # masked logits
        x[3, 1::2] = -np.inf
        x[3, 0] = 0.0
    else:
        x[1] *= 1e-30
        x[3] *= 1e20
    check(emulator, tmp_path, words, reduction, rows=x.float())


@pytest.mark.parametrize(
    "reduction,dtype,B",
    [
        ("sum", torch.float32, 40),
        ("max", torch.float32, 40),
        ("log_mass", torch.float32, 40),
        ("log_mass", torch.bfloat16, 40),
        ("sum", torch.float64, 40),
        ("sum", torch.float64, 16),
        ("max", torch.float64, 19),
    ],
)
def test_staged_rows_give_what_the_input_rows_give(emulator, tmp_path, reduction, dtype, B):
    """B >= 8: (a1) stages the rows, a tile block's rows side by side and the columns in
    leaf order, and the tile kernel gathers from there (without the workspace: from the
    input rows). 40 rows: a block of 32 and a partial one of 8; 16 and 19: one of 16 (and
    3). Full blocks of float32 x 32 or float64 x 16 rows read a leaf's values as one
    128-byte line, which the tile kernel then drops from L2: the emulation fills it with
    NaN, so a second read of it would show. Rows wider than the vocabulary, -inf masks.
    Both ways match the reference; sum and max read the same values, so they agree bit for
    bit. The row pass runs either way (for the row check; log_mass: the lse), so staging
    takes no launch more."""
    words = [bytes(np.random.default_rng(i).integers(97, 101, size=1 + i % 5)) for i in range(220)]
    layout = make_trie(words).layout
    rng = np.random.default_rng(11)
    x = make_values(
        rng, B, layout.num_columns + 37, reduction, spread=15.0, neg_inf=0.1, dtype=dtype
    )
    runs = staged_and_not(emulator, tmp_path, x, layout, reduction, f"{reduction}/{dtype}")
    got = {stage: run[1] for stage, run in runs.items()}
    launches = {stage: run[0] for stage, run in runs.items()}
    if reduction != "log_mass":
        np.testing.assert_array_equal(got[True], got[False])
    assert launches[True] == launches[False]


@pytest.mark.parametrize("row_pass_blocks", [1, 3])
@pytest.mark.parametrize(
    "reduction,dtype,B",
    [
        ("sum", torch.float32, 8),
        ("log_mass", torch.float32, 40),
        ("log_mass", torch.bfloat16, 16),
        ("max", torch.float64, 40),
        ("sum", torch.float64, 19),
        ("log_mass", torch.float64, 8),
    ],
)
def test_row_pass_blocks_of_many_rounds(emulator, tmp_path, reduction, dtype, B, row_pass_blocks):
    """(a1) reads its slice in rounds, each round's loads issued before the round before is
    staged, through two shared buffers: with the device taken as holding 1 or 3 blocks at
    once, each block reads 2 to 27 rounds (float32: 512, 256 or 128 columns a round at 8, 16
    or 32 rows a block; 8-byte values half as many), the last one partial; full and partial
    blocks of rows, and 1,500 columns past the vocabulary, which no leaf reads. Staged and not, the
    result is the reference's (sum and max: bit for bit the same both ways), and so is each
    row's lse."""
    words = [bytes(np.random.default_rng(i).integers(97, 101, size=1 + i % 5)) for i in range(220)]
    layout = make_trie(words).layout
    rng = np.random.default_rng(B)
    x = make_values(
        rng, B, layout.num_columns + 1500, reduction, spread=15.0, neg_inf=0.1, dtype=dtype
    )
    runs = staged_and_not(
        emulator,
        tmp_path,
        x,
        layout,
        reduction,
        f"{reduction}/{dtype}",
        row_pass_blocks=row_pass_blocks,
    )
    got = {stage: run[1] for stage, run in runs.items()}
    lse = {stage: run[2][:, -2] + run[2][:, -1] for stage, run in runs.items()}  # the pair
    if reduction == "log_mass":
        want_lse = torch.logsumexp(x.double(), dim=1).numpy()
        for stage in (True, False):
            np.testing.assert_allclose(lse[stage], want_lse, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(got[True], got[False])


def test_staged_rows_follow_each_modes_leaf_order(emulator, tmp_path, monkeypatch):
    """With EOS tokens the two modes order the leaves differently (with_eos moves the EOS
    tokens' leaves under the EOS node), so each mode stages the columns at its own leaf
    positions, from the column_leaf cuda_backend builds for it (through dispatch, the
    kernels emulated); a column past the vocabulary is staged nowhere."""
    words = [bytes(np.random.default_rng(i).integers(97, 100, size=1 + i % 4)) for i in range(90)]
    words = list(dict.fromkeys(words))
    trie = make_trie(words, eos=[words[3], words[40]])
    orders = {m: trie.layout.modes[m].leaf_token for m in ("without_eos", "with_eos")}
    assert not np.array_equal(orders["without_eos"], orders["with_eos"])
    use_emulated_binding(monkeypatch, emulator, tmp_path, trie.layout)
    rng = np.random.default_rng(4)
    for reduction in ("sum", "log_mass"):
        x = make_values(rng, 12, trie.layout.num_columns + 5, reduction, neg_inf=0.05)
        for mode in orders:
            got, used = dispatch.trie_reduce(x, trie.layout, reduction, mode=mode)
            assert used == "cuda"
            assert_matches(
                got.numpy(),
                reference(x, trie.layout, reduction, mode),
                reduction,
                f"{reduction}/{mode}",
            )


@pytest.mark.parametrize("B", [1, 3])
def test_log_mass_rows_split_into_slices(emulator, tmp_path, B):
    """Rows much wider than the vocabulary: the row log-sum-exp is split into several slices
    per row (partials in scratch, merged by one warp per row), with -inf runs that leave
    whole slices without mass."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(150)]
    rng = np.random.default_rng(B)
    rows = rng.standard_normal((B, 30000)) * 20
    rows[:, 5000:17000] = -np.inf
    check(emulator, tmp_path, words, "log_mass", rows=torch.from_numpy(rows).float())


def test_a_real_vocabulary_slice(emulator, tmp_path):
    """The real byte strings of Llama-3's first 2,000 tokens (skipped without quicktok)."""
    quicktok = pytest.importorskip("quicktok")
    enc = quicktok.get_encoding("llama3")
    words = [enc.decode_single_token_bytes(i) for i in range(2000)]
    for reduction in ("sum", "max", "log_mass"):
        check(
            emulator,
            tmp_path,
            words,
            reduction,
            B=2,
            eos={words[-1]},
            spread=20.0,
            neg_inf=0.01,
            extra=17 if reduction == "log_mass" else 0,
        )


def test_bad_arguments_are_refused_before_any_launch(emulator, tmp_path):
    """trie_reduce's own argument checks (cudaErrorInvalidValue, nothing launched): a tile
    past kMaxTile; staging with a column_leaf longer than the rows."""
    trie = make_trie([b"a", b"b"])
    x = torch.zeros(1, 2)
    # a tile the kernels refuse (its shared memory would pass the limit)
    status, _, launches, _, _ = run_emulated(
        emulator, str(tmp_path), x, trie.layout, "sum", tile=100000
    )
    assert status == 1 and launches == 0  # cudaErrorInvalidValue
    # 8 rows (staged): the row pass would write leaf positions past a row block's C * 8
    # values; the same call with the right column_leaf runs
    x = torch.zeros(8, 2)
    for column_leaf, want in (([0, 1, -1], 1), ([0, 1], 0)):
        status, _, launches, _, _ = run_emulated(
            emulator, str(tmp_path), x, trie.layout, "sum", column_leaf=np.array(column_leaf)
        )
        assert status == want and (launches == 0) == (want == 1)


@pytest.mark.parametrize("stage", [True, False], ids=["staged", "unstaged"])
def test_row_lse_flags_exactly_the_bad_rows(emulator, tmp_path, stage):
    """(a1)/(a2) leave each row's lse as a pair in the last two scratch columns, the max and
    log(sum exp(x - max)): the latter NaN for a row with a NaN or +inf logit or no finite one,
    finite otherwise, which cuda_backend reads as the row check
    (no separate pass over the logits); 9 rows, so (a1) stages them (blocks of 8 rows and 1,
    threads sharing a row merging by shuffles) or, unstaged, takes a block per row slice
    (its warps merging through shared memory). Rows 30,000 wide take several slices: a NaN in one
    slice among finite ones, a NaN inside a slice of -inf (a masked row: the slice's sum
    stays 0, so only the flag can carry it), in the padding columns past the vocabulary, and
    a +inf; good rows with -inf masks and whole -inf slices stay finite and exact."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(150)]
    trie = make_trie(words)
    rng = np.random.default_rng(9)
    rows = rng.standard_normal((9, 30000)) * 20
    rows[1, 7] = np.nan
    rows[2, :] = -np.inf
    rows[2, 0] = 0.0
    rows[2, 20000] = np.nan  # NaN in a slice of -inf
    rows[3, 29999] = np.nan  # past the vocabulary (padding)
    rows[4, 15000] = np.inf
    rows[5, :] = -np.inf  # no finite logit
    rows[6, 5000:29000] = -np.inf  # good: whole slices without mass
    rows[7, ::2] = -np.inf  # good: a mask
    rows[8, 100] = -np.inf
    rows[8, 101] = np.inf  # +inf next to -inf
    bad = [1, 2, 3, 4, 5, 8]
    for dtype in (torch.float32, torch.float16, torch.float64):
        x = torch.from_numpy(rows).to(dtype)
        status, errors, _, got, scratch = run_emulated(
            emulator, str(tmp_path), x, trie.layout, "log_mass", stage=stage
        )
        assert status == 0 and errors == 0
        row_max, log_sum = scratch[:, -2], scratch[:, -1]
        assert np.flatnonzero(~np.isfinite(log_sum)).tolist() == bad, (dtype, log_sum)
        assert np.isnan(log_sum[bad]).all()
        good = [r for r in range(len(rows)) if r not in bad]
        np.testing.assert_array_equal(row_max[good], x[good].double().amax(dim=1).numpy())
        want_lse = torch.logsumexp(x[good].double(), dim=1).numpy()
        np.testing.assert_allclose(row_max[good] + log_sum[good], want_lse, rtol=0, atol=1e-6)
        assert_matches(got[good], reference(x[good], trie.layout, "log_mass"), "log_mass")


@pytest.mark.parametrize("stage", [True, False], ids=["staged", "unstaged"])
def test_row_check_of_sum_and_max_flags_exactly_the_nan_rows(emulator, tmp_path, stage):
    """sum and max: (a1) leaves 0 in each row's last scratch column, NaN exactly for a row
    with a NaN value (+inf and -inf weights are values like any other), staging the rows
    (blocks of 8 rows and 1) or reading them for the check alone (unstaged: a block per row
    slice). Rows 30,000 wide take several slices: a NaN in a middle slice, in the padding
    past the vocabulary, in the first column, in a row of -inf; the good rows' results are
    the reference's."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(150)]
    trie = make_trie(words)
    rng = np.random.default_rng(10)
    rows = rng.random((9, 30000))
    rows[1, 15000] = np.nan
    rows[3, 29999] = np.nan  # past the vocabulary (padding)
    rows[4, 0] = np.nan
    rows[5, :] = -np.inf
    rows[5, 20000] = np.nan
    rows[6, 7] = np.inf  # good
    rows[7, ::2] = -np.inf  # good
    bad = [1, 3, 4, 5]
    good = [r for r in range(len(rows)) if r not in bad]
    for dtype in (torch.float32, torch.float64):
        x = torch.from_numpy(rows).to(dtype)
        for reduction in ("sum", "max"):
            status, errors, _, got, scratch = run_emulated(
                emulator, str(tmp_path), x, trie.layout, reduction, stage=stage
            )
            assert status == 0 and errors == 0
            check = scratch[:, -1]
            assert np.flatnonzero(np.isnan(check)).tolist() == bad, (dtype, reduction, check)
            assert (check[good] == 0).all()
            assert_matches(got[good], reference(x[good], trie.layout, reduction), reduction)


def test_dispatcher_names_bad_rows_from_the_cuda_row_pass(emulator, tmp_path, monkeypatch):
    """Through dispatch.trie_reduce and the real cuda_backend, with the emulated kernels as
    the extension (the binding's call, run by the emulator: scratch filled in place): the
    dispatcher makes no pass of its own over the values and names the first bad row from the
    row check the kernels leave in scratch (log_mass: the lse; sum and max: NaN for a row
    with a NaN); good rows give the reference's values."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(40)]
    layout = make_trie(words).layout
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((4, 43)) * 10
    # 9 rows: staged, in the leaf order of the column_leaf that cuda_backend builds
    staged_rows = torch.from_numpy(rng.standard_normal((9, 43)) * 10).float()
    want = {
        B: reference(x, layout, "log_mass")
        for B, x in ((4, torch.from_numpy(rows).float()), (9, staged_rows))
    }
    # sum and max: staged (9 rows) or read for the check alone (3)
    weights = {B: torch.from_numpy(rng.random((B, 43))).float() for B in (3, 9)}
    want_weights = {
        (B, reduction): reference(w, layout, reduction)
        for B, w in weights.items()
        for reduction in ("sum", "max")
    }

    use_emulated_binding(monkeypatch, emulator, tmp_path, layout)
    passes = []
    real_row_check = dispatch.row_check
    monkeypatch.setattr(
        dispatch, "row_check", lambda values: passes.append(values.shape) or real_row_check(values)
    )

    out, used = dispatch.trie_reduce(torch.from_numpy(rows).float(), layout, "log_mass")
    assert used == "cuda" and passes == []
    assert_matches(out.numpy(), want[4], "log_mass")
    out, used = dispatch.trie_reduce(staged_rows, layout, "log_mass")
    assert used == "cuda" and passes == []
    assert_matches(out.numpy(), want[9], "log_mass")
    for value, message in [
        (np.nan, "logit row 2 contains NaN"),
        (np.inf, r"logit row 2 contains \+inf"),
        (-np.inf, r"logit row 2 has no finite logit \(all -inf\)"),
    ]:
        bad = rows.copy()
        if value == -np.inf:
            bad[2] = -np.inf
        else:
            bad[2, 42] = value  # in a padding column, past the vocabulary
        bad[3, 0] = np.nan  # a later bad row: the first one is named
        with pytest.raises(ValueError, match=message):
            dispatch.trie_reduce(torch.from_numpy(bad).float(), layout, "log_mass")
    assert passes == []
    for B, w in weights.items():
        for reduction in ("sum", "max"):
            out, used = dispatch.trie_reduce(w, layout, reduction)
            assert used == "cuda"
            assert_matches(out.numpy(), want_weights[B, reduction], reduction)
        bad = w.clone()
        bad[1, 41] = float("inf")  # allowed in weights
        bad[2, 42] = float("nan")  # in a padding column
        bad[B - 1, 0] = float("nan")
        for reduction in ("sum", "max"):
            with pytest.raises(ValueError, match="weight row 2 contains NaN"):
                dispatch.trie_reduce(bad, layout, reduction)
    assert passes == []
