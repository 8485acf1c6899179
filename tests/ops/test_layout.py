"""The trie builder (``trie_structure.build_structure``): its vectorised path for ``bytes`` words
against the insertion loop every other vocabulary takes, and both against genlm.backend's
own trie numbering."""

from __future__ import annotations

import warnings

import genlm.backend.trie as ref_trie
import numpy as np
import pytest
from genlm.backend.tokenization import Token as RefToken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.vocabs import byte_vocab
from genlm_fast.backend.tokenization import Token
from genlm_fast.backend.trie import TokenCharacterTrie
from genlm_fast.ops import layout, trie_structure
from tests.ops.devices import device_for

WORDS = st.lists(
    st.binary(max_size=9) | st.sampled_from([b"", b"a", b"ab", b"abc", b"\xff"]),
    min_size=1,
    max_size=40,
)


def both_paths(words, add_eos_node):
    keys = [(None, i) for i in range(len(words))]
    vectorised = trie_structure.build_structure(words, keys, add_eos_node, "EOS")
    loop = trie_structure.build_structure([list(w) for w in words], keys, add_eos_node, "EOS")
    return vectorised, loop


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(words=WORDS, add_eos_node=st.booleans())
def test_bytes_path_equals_the_insertion_loop(words, add_eos_node):
    assert_same(*both_paths(words, add_eos_node))


@pytest.mark.parametrize(
    "words", [[b""], [b"", b""], [b"a" * 200, b"a" * 3, b"a"], [bytes([i]) for i in range(256)]]
)
def test_bytes_path_edge_cases(words):
    assert_same(*both_paths(words, True))


def test_bytes_path_on_a_real_vocabulary():
    assert_same(*both_paths([bytes(t) for t in byte_vocab("gpt2")], False))


def test_long_words_take_the_loop(monkeypatch):
    words = [b"abc", b"ab", b"b"]
    expected = trie_structure.build_structure(words, [(None, i) for i in range(3)])
    monkeypatch.setattr(trie_structure, "_creation_order_of_bytes", None)  # must not be called
    monkeypatch.setattr(trie_structure, "_MAX_PADDED_CELLS", 8)
    assert_same(trie_structure.build_structure(words, [(None, i) for i in range(3)]), expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(words=WORDS)
def test_numbering_matches_genlm(words):
    mine = TokenCharacterTrie([Token(i, w) for i, w in enumerate(words)], cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ref_trie.TokenCharacterTrie([RefToken(i, w) for i, w in enumerate(words)])
    assert mine.children == ref.children
    assert mine.word2leaf == ref.word2leaf


# --------------------------------------------------------------------------- tile decomposition


def evaluate_tiles(ml, num_nodes, weights):
    """Node sums from a mode's tile decomposition alone, the way the Triton kernels read it:
    every local range into its destination, then spanning nodes from their pieces and whole
    tile totals (float64, plain numpy)."""
    out = np.full(num_nodes, np.nan)
    scratch = np.full(ml.num_scratch, np.nan)
    leaf_w = weights[ml.leaf_token]
    for start, end, dest in zip(ml.range_start, ml.range_end, ml.range_dest):
        value = leaf_w[start:end].sum()
        if dest >= 0:
            out[dest] = value
        else:
            scratch[-1 - dest] = value
    return _spanning_nodes(ml, out, scratch)


def evaluate_sources(ml, num_nodes, weights):
    """The same from the tiles' sources, the way the CUDA tile kernel reads them: per tile,
    its leaf values and run sums, each owned node and scratch value copied from its source
    code (a position, tile + a run, 2 * tile - 2: the whole tile, or 2 * tile - 1: none, the
    empty value 0), then the spanning nodes."""
    out = np.full(num_nodes, np.nan)
    scratch = np.full(ml.num_scratch, np.nan)
    leaf_w = np.zeros(len(ml.tile_node_lo) * ml.tile)  # whole tiles
    leaf_w[: len(ml.leaf_token)] = weights[ml.leaf_token]
    tile = ml.tile
    for t in range(len(ml.tile_node_lo) - 1):
        leaves = leaf_w[t * tile : (t + 1) * tile]
        bounds = ml.run_bounds[ml.tile_run_ptr[t] : ml.tile_run_ptr[t + 1]]
        # nested ranges of 2+ leaves but the whole tile: at most tile - 2
        assert len(bounds) <= max(tile - 2, 0)
        n_leaves = min(tile, len(ml.leaf_token) - t * tile)
        runs = [leaves[b & 0xFFFF : b >> 16].sum() for b in bounds]
        assert all(2 <= (b >> 16) - (b & 0xFFFF) < n_leaves for b in bounds)
        source = np.zeros(2 * tile)  # [2 * tile - 1]: the empty value
        source[:tile] = leaves
        source[tile : tile + len(runs)] = runs
        if n_leaves >= 2:
            source[2 * tile - 2] = leaves.sum()
        nodes = slice(ml.tile_node_lo[t], ml.tile_node_lo[t + 1])
        out[nodes] = source[ml.node_src[nodes]]
        q = slice(ml.tile_scratch_ptr[t], ml.tile_scratch_ptr[t + 1])
        scratch[ml.scratch_slot[q]] = source[ml.scratch_src[q]]
    spanning = out.copy()
    spanning[ml.span_node] = np.nan  # written by the span pass, none in its tile
    assert (ml.node_src[ml.span_node] == 2 * tile - 1).all()
    return _spanning_nodes(ml, spanning, scratch)


def _spanning_nodes(ml, out, scratch):
    """Writes the spanning nodes from their pieces and whole tiles."""
    for node, left, right, lo, hi in zip(
        ml.span_node, ml.span_left, ml.span_right, ml.span_tile_lo, ml.span_tile_hi
    ):
        parts = list(scratch[lo:hi]) + [scratch[s] for s in (left, right) if s >= 0]
        out[node] = np.sum(parts)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    words=st.lists(
        st.binary(max_size=12).map(lambda b: bytes(x % 3 + 97 for x in b)), min_size=1, max_size=400
    ),
    n_eos=st.integers(0, 2),
    tile=st.sampled_from([1, 2, 8, 64]),
)
def test_tile_decomposition_gives_every_node(words, n_eos, tile):
    """Every node is written once, by a local range or as a spanning node, and the sums
    agree with the float64 oracle, read as ranges (Triton) or as sources (CUDA); within each
    tile the unit ranges (one leaf) come first; the blocks of node ids the tiles own
    partition the nodes and hold their ranges."""
    from genlm_fast.bytes import TokenByteTrie
    from tests import oracle

    eos = sorted(set(words[:n_eos]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layout, "TILE", tile)
        trie = TokenByteTrie(
            [Token(i, w) for i, w in enumerate(words)],
            device="cpu",
            eos_byte_strings=eos,
            cache=False,
            kernel_backend="reference",
        )
    weights = np.random.default_rng(len(words)).random(len(words))
    eos_positions = [i for i, w in enumerate(words) if w in set(eos)]
    for mode, ml in trie.layout.modes.items():
        assert ml.tile == tile
        lengths = ml.range_end - ml.range_start
        for t in range(len(ml.tile_range_ptr) - 1):
            r0, u1, r1 = ml.tile_range_ptr[t], ml.tile_unit_end[t], ml.tile_range_ptr[t + 1]
            assert r0 <= u1 <= r1
            assert (lengths[r0:u1] == 1).all() and (lengths[u1:r1] != 1).all()
            inside = (ml.range_start[r0:r1] >= t * tile) & (ml.range_end[r0:r1] <= (t + 1) * tile)
            assert inside[lengths[r0:r1] > 0].all()
            # the CUDA tile kernel writes the node ids the tile owns as one block: every
            # node a range of this tile gives (empty ones aside) lies in it
            dest = ml.range_dest[r0:r1][lengths[r0:r1] > 0]
            dest = dest[dest >= 0]
            assert ((dest >= ml.tile_node_lo[t]) & (dest < ml.tile_node_lo[t + 1])).all()
        node_lo = ml.tile_node_lo
        assert len(node_lo) == len(ml.tile_range_ptr) and node_lo[0] == 0
        assert node_lo[-1] == trie.layout.num_nodes and (np.diff(node_lo) >= 0).all()
        # a spanning node is in the block of the tile of its last leaf
        last_tile = (ml.leaf_end[ml.span_node] - 1) // tile
        assert (
            (node_lo[last_tile] <= ml.span_node) & (ml.span_node < node_lo[last_tile + 1])
        ).all()
        dests = np.concatenate([ml.range_dest[ml.range_dest >= 0], ml.span_node])
        np.testing.assert_array_equal(np.sort(dests), np.arange(trie.layout.num_nodes))
        want = oracle.reduce(
            oracle.members(trie, eos_positions, with_eos=mode == "with_eos"),
            trie.layout.num_nodes,
            weights[None],
            "sum",
        )[0]
        np.testing.assert_allclose(
            evaluate_tiles(ml, trie.layout.num_nodes, weights), want, rtol=1e-12, atol=0
        )
        np.testing.assert_allclose(
            evaluate_sources(ml, trie.layout.num_nodes, weights), want, rtol=1e-12, atol=0
        )


def test_each_column_feeds_at_most_one_leaf():
    """compile_layout refuses token columns shared by two vocabulary positions, or negative:
    the CUDA tile kernel drops the staged values it has read from L2, which is only right
    when no other leaf reads that column. A permutation of the columns is accepted, and each
    mode's leaf order then holds every column once."""
    words = [b"a", b"ab", b"b"]
    keys = [(None, i) for i in range(len(words))]
    parent, first, leaf_node, edge_key, eos_node = trie_structure.build_structure(
        words, keys, True, "EOS"
    )
    for columns in ([0, 1, 0], [0, -1, 2]):
        with pytest.raises(ValueError, match="token columns must be distinct and non-negative"):
            layout.compile_layout(parent, first, leaf_node, columns, edge_key, eos_node)
    built = layout.compile_layout(
        parent, first, leaf_node, [7, 2, 5], edge_key, eos_node, eos_positions=[2]
    )
    for ml in built.modes.values():
        assert sorted(ml.leaf_token.tolist()) == [2, 5, 7]


def test_each_backend_gets_the_arrays_it_reads_and_no_other():
    """TrieLayout.device_arrays(mode, device, backend) holds BACKEND_ARRAYS[backend] and the
    mode's scalars, each array equal to the layout's and copied once whichever backends
    read it; each backend, run on them with a dict that records what is read, reads every
    array it is given and nothing else (the CUDA extension replaced by a stand-in that
    takes its arguments: cuda_backend reads the arrays on the host)."""
    import torch

    from genlm_fast.bytes import TokenByteTrie
    from genlm_fast.ops import cpu_backend, cuda_backend, extension, reference, triton_backend

    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(300)]
    trie = TokenByteTrie(
        [Token(i, w) for i, w in enumerate(words)],
        device="cpu",
        eos_byte_strings=[words[5]],
        cache=False,
    )
    lay = trie.layout
    scalars = {"num_columns", "span_narrow", "span_warp"}
    modules = {
        "reference": reference,
        "cpu": cpu_backend,
        "triton": triton_backend,
        "cuda": cuda_backend,
    }
    assert set(layout.BACKEND_ARRAYS) == set(modules)

    class Recording(dict):
        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

    class Binding:  # the CUDA extension's entry point: takes the arrays, returns zeros
        @staticmethod
        def trie_reduce_cuda(values, *args, **kwargs):
            return torch.zeros(values.shape[0], lay.num_nodes)

    for mode, ml in lay.modes.items():
        tensors = {}
        for backend, module in modules.items():
            # Triton's arrays on the GPU where there is one (no interpreter there); the CUDA
            # backend's stand-in below takes host arrays
            device = "cpu" if backend == "cuda" else device_for(backend)
            arrays = lay.device_arrays(mode, device, backend)
            assert arrays is lay.device_arrays(mode, device, backend)  # built once
            names = set(layout.BACKEND_ARRAYS[backend])
            assert set(arrays) == names | scalars, backend
            for name in names:
                want = lay.parent if name == "parent" else getattr(ml, name)
                np.testing.assert_array_equal(arrays[name].cpu().numpy(), want)
                assert tensors.setdefault((device, name), arrays[name]) is arrays[name]
            read = set()
            x = torch.rand(2, lay.num_columns, device=device)
            if backend == "cuda":
                patch = pytest.MonkeyPatch()
                patch.setattr(extension, "has", lambda kind: kind == "cuda")
                patch.setattr(extension, "load_module", lambda: Binding)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    module.trie_reduce(
                        x,
                        Recording(arrays),
                        "sum",
                        num_nodes=lay.num_nodes,
                        num_scratch=ml.num_scratch,
                        tile=ml.tile,
                    )
                finally:
                    if backend == "cuda":
                        patch.undo()
            derived = {key for key in read if key.startswith("_")}  # the backend's own cache
            assert read - derived - scalars == names, (backend, sorted(read))
    with pytest.raises(ValueError, match="unknown backend 'numba'"):
        lay.device_arrays("without_eos", "cpu", "numba")
