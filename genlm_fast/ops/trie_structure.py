"""A vocabulary trie numbered as genlm numbers it (`build_structure`).

Nodes are numbered in post-order: children before parents, siblings in the order they were
first created, root last. Words of ``bytes`` take a vectorised path
(`_creation_order_of_bytes`), any other word (a sequence of edge keys) the dict-trie loop
(`_creation_order`); both give the same creation order, which `_number_postorder` turns into
ids. ``layout.compile_layout`` turns the result into the kernels' index arrays.
"""

from __future__ import annotations

import numpy as np

__all__ = ["build_structure"]

# the bytes path pads every word to the longest: above this many cells it takes the loop
_MAX_PADDED_CELLS = 1 << 26


def _number_postorder(parent, depth):
    """Post-order ids and each node's first subtree id, for a tree given by ``parent`` and
    ``depth`` in creation order (a parent is created before its children, and siblings in
    the order they are visited). Vectorised level by level: subtree sizes bottom-up, then
    each subtree's first id top-down (its parent's first id + the sizes of its earlier
    siblings); the node itself comes last in its subtree."""
    n = len(parent)
    by_depth = np.argsort(depth, kind="stable")
    level_end = np.searchsorted(depth[by_depth], np.arange(int(depth.max()) + 2), side="left")
    levels = [by_depth[level_end[d] : level_end[d + 1]] for d in range(1, len(level_end) - 1)]
    size = np.ones(n, dtype=np.int64)
    for nodes in reversed(levels):  # deepest first: a node's size is final before it is added
        np.add.at(size, parent[nodes], size[nodes])
    by_parent = np.argsort(parent, kind="stable")  # siblings stay in creation order
    sizes = size[by_parent]
    before = np.cumsum(sizes) - sizes  # sizes of everything earlier in by_parent
    group_parent = parent[by_parent]
    group_start = np.flatnonzero(np.r_[True, group_parent[1:] != group_parent[:-1]])
    group_len = np.diff(np.r_[group_start, n])
    offset = np.empty(n, dtype=np.int64)
    offset[by_parent] = before - np.repeat(before[group_start], group_len)
    first = np.zeros(n, dtype=np.int64)
    for nodes in levels:
        first[nodes] = first[parent[nodes]] + offset[nodes]
    return first + size - 1, first


def build_structure(words, leaf_keys, add_eos_node=False, eos_key=None):
    """Build the trie over ``words`` (each an iterable of edge keys) in genlm's numbering.

    ``leaf_keys[i]`` is the dict key of word i's leaf edge. With ``add_eos_node`` an empty
    node hangs from the root under ``eos_key`` after all words (genlm.bytes' EOS node).
    Returns (parent, node_first, leaf_node, edge_key, eos_node) in post-order ids.
    """
    words = list(words)
    if (
        words
        and all(type(w) is bytes for w in words)
        and (len(words) * max(map(len, words)) <= _MAX_PADDED_CELLS)
    ):
        parent_old, depth_old, edge_keys, old_leaf = _creation_order_of_bytes(words, leaf_keys)
    else:
        parent_old, depth_old, edge_keys, old_leaf = _creation_order(words, leaf_keys)
    old_eos = None
    if add_eos_node:
        old_eos = len(parent_old)
        parent_old = np.append(parent_old, 0)
        depth_old = np.append(depth_old, 1)
        edge_keys.append(eos_key)

    post, first = _number_postorder(parent_old, depth_old)
    n = len(post)
    node_first = np.empty(n, dtype=np.int32)
    node_first[post] = first
    parent = np.full(n, -1, dtype=np.int32)
    parent[post[1:]] = post[parent_old[1:]]
    old_of = np.empty(n, dtype=np.int64)  # post-order id -> old id
    old_of[post] = np.arange(n)
    edge_key = [edge_keys[old] for old in old_of.tolist()]
    leaf_node = post[old_leaf].astype(np.int32)
    eos_node = int(post[old_eos]) if old_eos is not None else None
    return parent, node_first, leaf_node, edge_key, eos_node


def _creation_order(words, leaf_keys):
    """Insert the words one by one into a dict trie. Returns, for the nodes in creation
    ("old") order, with the root first: parent, depth, edge key, and each word's leaf."""
    children = [{}]  # None for a leaf: nothing descends through it
    parent_old = [-1]
    edge_key_old = [None]
    depth_old = [0]
    old_leaf = []
    for word, leaf_key in zip(words, leaf_keys):
        node = 0
        for letter in word:
            kids = children[node]
            nxt = kids.get(letter)
            if nxt is None:
                nxt = kids[letter] = len(children)
                children.append({})
                parent_old.append(node)
                edge_key_old.append(letter)
                depth_old.append(depth_old[node] + 1)
            node = nxt
        leaf = children[node][leaf_key] = len(children)
        children.append(None)
        parent_old.append(node)
        edge_key_old.append(leaf_key)
        depth_old.append(depth_old[node] + 1)
        old_leaf.append(leaf)
    return (
        np.asarray(parent_old, dtype=np.int64),
        np.asarray(depth_old, dtype=np.int64),
        edge_key_old,
        np.asarray(old_leaf, dtype=np.int64),
    )


def _creation_order_of_bytes(words, leaf_keys):
    """``_creation_order`` for ``bytes`` words, vectorised (the same result).

    The inner nodes are the distinct non-empty prefixes. With the words sorted, the words
    sharing a prefix of length d are one run of the order, and a word starts a new run at
    depth d exactly when its common prefix with the word before it is shorter than d, so
    one pass per depth over the words that long numbers that depth's nodes. The loop would
    create a prefix while inserting the first word that has it, after that word's shorter
    prefixes, and a word's leaf after all its prefixes: sorting the nodes by (first word,
    depth) gives its creation order.
    """
    count = len(words)
    order = np.array(sorted(range(count), key=words.__getitem__), dtype=np.int64)
    length = np.fromiter(map(len, words), dtype=np.int64, count=count)[order]
    longest = int(length.max())
    # the words in sorted order as rows padded with 256, which is no byte
    padded = np.full((count, max(longest, 1)), 256, dtype=np.uint16)
    flat = np.frombuffer(b"".join(map(words.__getitem__, order.tolist())), dtype=np.uint8)
    starts = np.cumsum(length) - length
    padded[
        np.repeat(np.arange(count), length), np.arange(flat.size) - np.repeat(starts, length)
    ] = flat
    common = np.zeros(count, dtype=np.int64)  # common prefix with the word before, sorted
    if count > 1:
        differ = padded[1:] != padded[:-1]
        first_difference = np.where(differ.any(axis=1), differ.argmax(axis=1), longest)
        common[1:] = np.minimum(first_difference, length[1:])

    inner = int((length - common).sum())  # temporary ids: root 0, inner 1..inner, then leaves
    total = 1 + inner + count
    parent_tmp = np.full(total, -1, dtype=np.int64)
    depth_tmp = np.zeros(total, dtype=np.int64)
    letter_tmp = np.zeros(inner + 1, dtype=np.int64)
    first_word = np.full(total, -1, dtype=np.int64)
    node_at = np.zeros(count, dtype=np.int64)  # each sorted word's prefix node, this depth
    rows = np.arange(count)
    next_id = 1
    for depth in range(1, longest + 1):
        rows = rows[length[rows] >= depth]
        new = common[rows] < depth
        run_start = np.flatnonzero(new)
        ids = next_id + np.arange(run_start.size)
        starter = rows[run_start]
        parent_tmp[ids] = node_at[starter]
        depth_tmp[ids] = depth
        letter_tmp[ids] = padded[starter, depth - 1]
        first_word[ids] = np.minimum.reduceat(order[rows], run_start)
        node_at[rows] = ids[np.cumsum(new) - 1]
        next_id += run_start.size
    leaf_tmp = 1 + inner + np.arange(count)  # word i's leaf: 1 + inner + i
    parent_tmp[leaf_tmp[order]] = node_at
    depth_tmp[leaf_tmp[order]] = length + 1
    first_word[leaf_tmp] = np.arange(count)

    creation = np.argsort(first_word * (longest + 2) + depth_tmp, kind="stable")  # root first
    old_id = np.empty(total, dtype=np.int64)
    old_id[creation] = np.arange(total)
    parent_old = np.full(total, -1, dtype=np.int64)
    parent_old[1:] = old_id[parent_tmp[creation[1:]]]
    edge_key_tmp = letter_tmp.tolist()
    edge_key_tmp[0] = None
    edge_key_tmp.extend(leaf_keys)
    edge_key_old = [edge_key_tmp[t] for t in creation.tolist()]
    return parent_old, depth_tmp[creation], edge_key_old, old_id[leaf_tmp]
