"""Float64 brute-force oracle for trie reductions, independent of the kernel layout.

It reads only the public genlm-style structure (``children``, ``root``, ``word2leaf`` ...)
and recomputes every node from the set of vocabulary positions beneath it, the way the
genlm definition states it: no leaf order, no ranges, no tiles.
"""

from __future__ import annotations

import numpy as np


def members(trie, eos_positions=(), with_eos=False):
    """(node ids, vocab positions) pairs: position p counts towards node n."""
    children = trie.children
    leaf_to_position = {}
    if hasattr(trie, "token_id_to_leaf"):
        token_to_pos = {t.token_id: i for i, t in enumerate(trie.decode)}
        for tid, leaf in trie.token_id_to_leaf:
            leaf_to_position[int(leaf)] = token_to_pos[int(tid)]
    else:
        for pos, leaf in trie.idx_to_leaf:
            leaf_to_position[int(leaf)] = int(pos)
    eos = set(eos_positions) if with_eos else set()
    nodes, positions = [], []
    path = []

    def visit(node):  # iterative DFS keeping the current root path
        stack = [(node, False)]
        while stack:
            n, done = stack.pop()
            if done:
                path.pop()
                continue
            path.append(n)
            stack.append((n, True))
            if n in leaf_to_position:
                p = leaf_to_position[n]
                if p in eos:
                    nodes.extend([trie.eos_node, trie.root])
                    positions.extend([p, p])
                else:
                    nodes.extend(path)
                    positions.extend([p] * len(path))
            for child in children[n].values():
                stack.append((child, False))

    visit(trie.root)
    return np.asarray(nodes, dtype=np.int64), np.asarray(positions, dtype=np.int64)


def reduce(pairs, num_nodes, rows, reduction, columns=None):
    """Oracle node values ``[B, N]`` in float64 (rows: ``[B, C]`` array)."""
    nodes, positions = pairs
    rows = np.asarray(rows, dtype=np.float64)
    cols = positions if columns is None else np.asarray(columns)[positions]
    out = []
    for row in rows:
        if reduction == "sum":
            acc = np.zeros(num_nodes)
            np.add.at(acc, nodes, row[cols])
        elif reduction == "max":
            acc = np.full(num_nodes, -np.inf)
            np.maximum.at(acc, nodes, row[cols])
            has = np.zeros(num_nodes, bool)
            has[nodes] = True
            acc[~has] = 0.0
        else:
            finite = row[np.isfinite(row)]
            top = finite.max()
            # relative to the top logit: top + log(sum) would round the log away at |top| ~ 1e19
            logp = (row - top) - np.log(np.exp(row - top).sum())
            vals = logp[cols]
            peak = np.full(num_nodes, -np.inf)
            np.maximum.at(peak, nodes, vals)
            safe = np.where(np.isfinite(peak), peak, 0.0)
            acc = np.zeros(num_nodes)
            np.add.at(acc, nodes, np.exp(vals - safe[nodes]))
            with np.errstate(divide="ignore"):
                acc = np.where(np.isfinite(peak), safe + np.log(acc), -np.inf)
        out.append(acc)
    return np.stack(out)


def assert_close(got, want, reduction, label=""):
    """The tolerances every backend must meet."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, (label, got.shape, want.shape)
    assert not np.isnan(got).any(), f"{label}: NaN in result"
    if reduction == "max":
        np.testing.assert_array_equal(
            got, want.astype(np.float32).astype(np.float64), err_msg=label
        )
    elif reduction == "sum":
        big = np.abs(want) >= 1e-30
        rel = np.abs(got[big] - want[big]) / np.abs(want[big])
        assert rel.size == 0 or rel.max() <= 1e-5, f"{label}: max relative error {rel.max():.3g}"
        assert np.all(got[want == 0] == 0), f"{label}: mass where there is none"
    else:
        neg_inf = np.isneginf(want)
        assert np.array_equal(np.isneginf(got), neg_inf), (
            f"{label}: -inf at {np.flatnonzero(np.isneginf(got) != neg_inf)[:10]}"
        )
        assert np.isfinite(got[~neg_inf]).all(), f"{label}: non-finite where the mass is finite"
        keep = want >= -80
        err = np.abs(got[keep] - want[keep])
        assert err.size == 0 or err.max() <= 1e-4, f"{label}: max abs error {err.max():.3g}"
        deep = np.isfinite(want) & ~keep  # far below the row's mass: relative error
        rel = np.abs(got[deep] - want[deep]) / np.abs(want[deep])
        assert rel.size == 0 or rel.max() <= 1e-5, (
            f"{label}: max relative error {rel.max():.3g} below -80"
        )
