"""Numerics of the compiled CPU trie kernels (``csrc/``, module ``genlm_fast._C``), against
the float64 plain-torch reference (tests/ops/extension_cases.py).

* through the dispatcher (``backend="cpu"``) it matches the reference on small layouts: both
  trie modes, all reductions, float32/float64 (and half/bfloat16 logits), rows wider than the
  vocabulary, permuted token columns;
* log_mass edge cases: leaves hundreds of nats down (a subtree at log-prob ~-800 gives ~-800,
  not -inf), -1e9 "masks", -inf logits (no NaN);
* max with negative / -inf weights and empty nodes;
* the one-row path that splits the node range over several threads, and the row-parallel path;
* large results come from a pool that never hands out a live block;
* bad input to the raw extension function raises a clear error.

The big cross-backend numerics test lives in test_trie_reduce.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genlm_fast.ops import cpu_backend, extension, trie_reduce
from tests.ops.devices import cpu_extension_required as cpu_extension_required  # autouse
from tests.ops.extension_cases import (
    MODES,
    REDUCTIONS,
    assert_matches,
    layout_named,
    random_values,
    raw_cpu,
    reference,
)

# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", ["one", "seven", "random", "permuted"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference(name, mode, reduction, dtype):
    layout = layout_named(name)
    rng = np.random.default_rng(len(name) * 7 + len(mode))
    for B in (1, 4, 19):  # 19 rows on 2 threads: blocks of 8, 2 and 1 rows
        x = random_values(rng, layout, B, reduction, dtype, extra_columns=3)
        out, used = trie_reduce(x, layout, reduction, mode, backend="cpu")
        assert used == "cpu"
        expected_dtype = (
            torch.float64 if (dtype == torch.float64 and reduction != "log_mass") else torch.float32
        )
        assert out.dtype == expected_dtype
        assert_matches(out, reference(x, layout, reduction, mode))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_log_mass_half_precision_logits(dtype, mode):
    layout = layout_named("random")
    x = random_values(np.random.default_rng(5), layout, 3, "log_mass", dtype)
    x[1, ::7] = float("-inf")
    out, _ = trie_reduce(x, layout, "log_mass", mode, backend="cpu")
    assert_matches(out, reference(x, layout, "log_mass", mode))


def _subtree_nodes(layout, mode, columns):
    """Nodes all of whose leaves are among ``columns`` (and which have leaves)."""
    ml = layout.modes[mode]
    inside = np.isin(ml.leaf_token, np.asarray(sorted(columns)))
    start, end = ml.leaf_start, ml.leaf_end
    csum = np.concatenate([[0], np.cumsum(inside)])
    return np.nonzero((end > start) & (csum[end] - csum[start] == end - start))[0]


@pytest.mark.parametrize("mode", MODES)
def test_log_mass_hundreds_of_nats_down(mode):
    """A subtree whose leaves all sit ~800 nats below the rest keeps its log-mass (~-800),
    mixed with -inf leaves and -1e9 "masked" logits; never -inf or NaN where mass exists."""
    layout = layout_named("random")
    rng = np.random.default_rng(11)
    V = layout.num_columns
    x = torch.from_numpy(rng.standard_normal((3, V)))
    # every token whose column is in `deep` is ~-800 relative to the others
    ml = layout.modes[mode]
    deep_nodes = np.nonzero(ml.leaf_end - ml.leaf_start >= 3)[0]
    node = int(deep_nodes[len(deep_nodes) // 3])
    deep = set(ml.leaf_token[ml.leaf_start[node] : ml.leaf_end[node]].tolist())
    cols = torch.tensor(sorted(deep))
    x[0, cols] = -800.0 + torch.from_numpy(rng.standard_normal(len(cols)))
    x[1, cols] = -1e9  # a "mask" value instead of -inf: still finite mass
    x[2, cols] = -800.0
    x[2, cols[::2]] = float("-inf")  # some of the deep leaves are impossible
    out, _ = trie_reduce(x, layout, "log_mass", mode, backend="cpu")
    ref = reference(x, layout, "log_mass", mode)
    assert_matches(out, ref)
    nodes = _subtree_nodes(layout, mode, deep)
    assert node in nodes
    for row, level in ((0, -800.0), (1, -1e9)):  # row 2 has -inf leaves: see below
        vals = out[row, nodes]
        assert torch.isfinite(vals).all(), (row, vals)
        assert (vals < level + 50).all() and (vals > level - 50 * max(1.0, abs(level) / 800)).all()
    # the node itself: log(sum of exp) of its leaves, about -800 - lse(row)
    lse = torch.logsumexp(x[2].double(), 0)
    leaves = x[2, cols].double()
    expect = torch.logsumexp(leaves, 0) - lse
    assert abs(float(out[2, node]) - float(expect)) < 1e-3
    assert float(expect) < -790


@pytest.mark.parametrize("mode", MODES)
def test_log_mass_neg_inf_logits(mode):
    layout = layout_named("random")
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((2, layout.num_columns))).float()
    x[0, ::2] = float("-inf")
    x[1, 1:] = float("-inf")  # a single possible token
    out, _ = trie_reduce(x, layout, "log_mass", mode, backend="cpu")
    ref = reference(x, layout, "log_mass", mode)
    assert_matches(out, ref)
    assert torch.isneginf(out).any() and not torch.isnan(out).any()
    assert float(out[1, layout.root]) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_negative_and_empty(mode, dtype):
    layout = layout_named("random")
    rng = np.random.default_rng(4)
    x = -torch.from_numpy(rng.random((3, layout.num_columns)) * 10 + 1).to(dtype)
    x[1, ::3] = float("-inf")
    x[2, :] = float("-inf")
    out, _ = trie_reduce(x, layout, "max", mode, backend="cpu")
    assert_matches(out, reference(x, layout, "max", mode))
    ml = layout.modes[mode]
    empty = torch.from_numpy(np.nonzero(ml.leaf_start == ml.leaf_end)[0])
    assert len(empty) > 0  # the EOS node / the re-keyed EOS leaves
    assert (out[:, empty] == 0).all()
    nonempty = torch.from_numpy(np.nonzero(ml.leaf_start < ml.leaf_end)[0])
    assert (out[0, nonempty] < 0).all()
    assert torch.isneginf(out[2, nonempty]).all()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", MODES)
def test_split_row_and_row_parallel_paths(reduction, mode):
    """A trie over 32768 nodes: one row split across 2-4 threads, and several rows."""
    layout = layout_named("big")
    assert layout.num_nodes > 32768
    module, arrays, cpu = raw_cpu(layout, mode)
    rng = np.random.default_rng(8)
    x = random_values(rng, layout, 5, reduction)
    if reduction == "log_mass":
        x[1, ::5] = -900.0  # the exact pass inside the split-row path
        x[2, ::3] = float("-inf")
    ref = reference(x, layout, reduction, mode)
    for threads in (1, 2, 3, 4):
        for rows in (slice(0, 1), slice(1, 2), slice(2, 3), slice(0, 5)):
            out = cpu_backend.run_kernel(
                module, x[rows].contiguous(), arrays, reduction, check=True, num_threads=threads
            )
            assert_matches(out, ref[rows])
    # a NaN row is found by every path (the split-row one checks its column slices)
    bad = x.clone()
    bad[3, -1] = float("nan")
    for threads in (1, 2, 3, 4):
        for rows, name in ((slice(3, 4), 0), (slice(0, 5), 3)):
            with pytest.raises(ValueError, match=f"row {name} contains NaN"):
                cpu_backend.run_kernel(
                    module, bad[rows].contiguous(), arrays, reduction, num_threads=threads
                )


def test_large_results_reuse_memory_only_once_released():
    """Results of >= 16 MiB come from the extension's block pool: a live result (or a numpy
    view of one) is never overwritten by a later call, and a released block is reused."""
    layout = layout_named("big")
    rng = np.random.default_rng(21)
    B = (16 << 20) // (4 * layout.num_nodes) + 3
    xs = [random_values(rng, layout, B, "sum") for _ in range(3)]
    refs = [reference(x, layout, "sum", "without_eos") for x in xs]
    first, _ = trie_reduce(xs[0], layout, "sum", backend="cpu")
    first_view = first.numpy()  # numpy shares the block: it must keep it alive
    first_ptr = first.data_ptr()
    del first
    second, _ = trie_reduce(xs[1], layout, "sum", backend="cpu")
    second_ptr = second.data_ptr()
    assert second_ptr != first_ptr
    assert_matches(torch.from_numpy(first_view), refs[0])
    assert_matches(second, refs[1])
    del first_view, second  # both blocks back in the pool
    third, _ = trie_reduce(xs[2], layout, "sum", backend="cpu")
    assert third.data_ptr() in (first_ptr, second_ptr)  # no fresh mmap: a pooled block
    assert_matches(third, refs[2])
    fourth, _ = trie_reduce(xs[0], layout, "sum", backend="cpu")
    assert fourth.data_ptr() != third.data_ptr()
    assert_matches(fourth, refs[0])
    extension.load_module().empty_output_cache()
    assert_matches(third, refs[2])  # emptying the cache leaves live results alone


def test_result_pool_keeps_the_most_recent_sizes():
    """Once full (4 blocks), the pool makes room for the block just returned by freeing the
    oldest: results of a new trie or batch size get pooled memory from their second call on,
    instead of fresh pages on every call behind a pool full of sizes no longer asked for."""
    layout = layout_named("big")
    module = extension.load_module()
    module.empty_output_cache()
    rng = np.random.default_rng(22)
    rows_per_block = (2 << 20) // (4 * layout.num_nodes) + 1  # each size its own 2 MiB multiple
    base = (16 << 20) // (4 * layout.num_nodes) + 1
    sizes = []
    for k in range(6):
        B = base + k * rows_per_block
        x = random_values(rng, layout, B, "sum")
        out, _ = trie_reduce(x, layout, "sum", backend="cpu")
        nbytes = out.numel() * 4
        sizes.append((nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20))
        assert_matches(out, reference(x, layout, "sum", "without_eos"))
        del out  # back to the pool
        assert module.output_cache_sizes()[-1] == sizes[-1]
    assert len(set(sizes)) == 6
    assert module.output_cache_sizes() == sizes[-4:]
    module.empty_output_cache()
    assert module.output_cache_sizes() == []


# --------------------------------------------------------------------------- bad input


def test_raw_function_rejects_bad_input():
    layout = layout_named("seven")
    module, arrays, cpu = raw_cpu(layout)
    parent, node_of_leaf, leaf_token, empty = (
        arrays["parent"],
        cpu["node_of_leaf"],
        arrays["leaf_token"],
        cpu["empty"],
    )
    x = torch.randn(2, layout.num_columns)

    runs = {
        k: cpu[k]
        for k in ("run_end", "run_depth", "run_child_slot", "run_join_slot", "run_leaf", "run_of")
    }
    max_depth = cpu["max_depth"]
    assert runs["run_end"].numel() < layout.num_nodes  # the layout has links to merge

    def call(
        values=x,
        reduction="sum",
        par=parent,
        ln=node_of_leaf,
        lt=leaf_token,
        em=empty,
        max_dep=max_depth,
        **changed,
    ):
        r = {**runs, **changed}
        return module.trie_reduce_cpu(
            values,
            par,
            ln,
            lt,
            em,
            r["run_end"],
            r["run_depth"],
            r["run_child_slot"],
            r["run_join_slot"],
            r["run_leaf"],
            r["run_of"],
            max_dep,
            reduction,
            True,
            0,
        )

    out, bad_row = call()
    assert out.shape == (2, layout.num_nodes) and bad_row == -1
    with pytest.raises(RuntimeError, match="unknown reduction"):
        call(reduction="mean")
    with pytest.raises(RuntimeError, match="2-D"):
        call(values=x[0])
    with pytest.raises(RuntimeError, match="contiguous"):
        call(values=torch.randn(layout.num_columns, 2).t())
    with pytest.raises(RuntimeError, match="float32 or float64"):
        call(values=x.half())
    with pytest.raises(RuntimeError, match="float16, bfloat16, float32 or float64"):
        call(values=x.long(), reduction="log_mass")
    with pytest.raises(RuntimeError, match="float64_result is for sum and max"):
        module.trie_reduce_cpu(
            x,
            parent,
            node_of_leaf,
            leaf_token,
            empty,
            *runs.values(),
            max_depth,
            "log_mass",
            True,
            0,
            True,
        )
    wide, _ = module.trie_reduce_cpu(
        x, parent, node_of_leaf, leaf_token, empty, *runs.values(), max_depth, "sum", True, 0, True
    )
    assert wide.dtype == torch.float64
    assert torch.equal(wide, call(values=x.double())[0])
    with pytest.raises(RuntimeError, match="'parent' must be int32"):
        call(par=parent.long())
    with pytest.raises(RuntimeError, match="'run_of' must be int32"):
        call(run_of=runs["run_of"].long())
    with pytest.raises(RuntimeError, match="outside the"):
        call(values=x[:, :2].contiguous())  # fewer columns than the vocabulary
    bad_parent = parent.clone()
    bad_parent[0] = 0
    with pytest.raises(RuntimeError, match="post-order parent"):
        call(par=bad_parent)
    with pytest.raises(RuntimeError, match="> max_depth"):
        call(max_dep=max_depth - 1)
    # the runs: each malformed in one way
    end, depth, child, join, leaf, run_of = (runs[k] for k in runs)
    with pytest.raises(RuntimeError, match="run arrays need"):
        call(run_depth=depth[:-1].contiguous())
    with pytest.raises(RuntimeError, match="run_end must increase to N"):
        call(run_end=torch.cat([end[:-1], end[-1:] - 1]).contiguous())
    with pytest.raises(RuntimeError, match="run_of\\[0\\]"):
        call(run_of=(run_of + 1).to(torch.int32))
    first_run = (torch.arange(len(depth)) == 0).to(torch.int32)
    with pytest.raises(RuntimeError, match="run 0 has run_depth"):
        call(run_depth=(depth + first_run).to(torch.int32))
    # a stack slot other than the identity slot (max_depth + 1) for a run without children
    # (run 0) and for a first child (run 0 again), or the identity slot for a later sibling
    assert child[0] == join[0] == max_depth + 1
    with pytest.raises(RuntimeError, match="run_child_slot 0"):
        call(run_child_slot=(child - (max_depth + 1) * first_run).to(torch.int32))
    with pytest.raises(RuntimeError, match="run_join_slot 0"):
        call(run_join_slot=(join - (max_depth + 1) * first_run).to(torch.int32))
    later = int(torch.nonzero(join <= max_depth)[0])  # a run that joins earlier siblings
    with pytest.raises(RuntimeError, match=f"run {later} has .* run_join_slot {max_depth + 1}"):
        call(
            run_join_slot=torch.where(torch.arange(len(join)) == later, max_depth + 1, join).to(
                torch.int32
            )
        )
    with pytest.raises(RuntimeError, match="run_leaf must start at 0"):
        call(run_leaf=(leaf + 1).to(torch.int32))
    with_leaves = int(torch.nonzero(leaf[1:] > leaf[:-1])[0])  # a run with a leaf
    shifted = leaf.clone()
    shifted[with_leaves + 1] -= 1  # its last leaf listed under the next run
    with pytest.raises(RuntimeError, match="is listed under run"):
        call(run_leaf=shifted)
    # runs 0 and 1 merged into one: node end[0] starts its own run, it is no link
    merged_of = (run_of - (run_of >= 1).to(torch.int32)).to(torch.int32)
    with pytest.raises(RuntimeError, match="not the single-child parent"):
        call(
            run_end=end[1:].contiguous(),
            run_depth=depth[1:].contiguous(),
            run_child_slot=child[1:].contiguous(),
            run_join_slot=join[1:].contiguous(),
            run_leaf=torch.cat([leaf[:1], leaf[2:]]).contiguous(),
            run_of=merged_of,
        )
    with pytest.raises(RuntimeError, match="non-decreasing"):
        call(ln=node_of_leaf.flip(0).contiguous())
    with pytest.raises(RuntimeError, match="node_of_leaf has"):
        call(ln=node_of_leaf[:-1].contiguous())
    # rows the kernel rejects are reported, not raised: the first one's index comes back
    for reduction, value in (
        ("sum", "nan"),
        ("max", "nan"),
        ("log_mass", "nan"),
        ("log_mass", "inf"),
        ("log_mass", "all -inf"),
    ):
        bad = torch.randn(3, layout.num_columns + 5)
        if value == "all -inf":
            bad[1] = float("-inf")
        else:
            bad[1, -1] = float(value)  # a column past the vocabulary: still checked
        bad[2, 0] = float("nan")
        assert call(values=bad, reduction=reduction)[1] == 1, (reduction, value)
    with pytest.raises(TypeError):
        module.trie_reduce_cpu(x, parent, node_of_leaf, leaf_token, empty, max_depth)


def test_backend_rejects_narrow_rows_after_checking_once():
    """Called directly (not through the dispatcher), after its first call has checked the
    indices, the backend must still not read a row too narrow past its end."""
    layout = layout_named("permuted")
    arrays = layout.device_arrays("without_eos", "cpu", "cpu")
    wide = torch.rand(1, layout.num_columns)
    cpu_backend.trie_reduce(wide, arrays, "sum", num_nodes=layout.num_nodes)
    assert cpu_backend.cpu_arrays(arrays)["checked"]
    with pytest.raises(ValueError, match="at least"):
        cpu_backend.trie_reduce(
            wide[:, :-1].contiguous(), arrays, "sum", num_nodes=layout.num_nodes
        )
