"""Token healing: when no hypothesis can read the next byte, re-tokenize the current token.

A hypothesis sits inside a token whose bytes so far are ``partial``. If the next byte
cannot follow, another tokenization might: commit ``partial[:k]`` as a token (for k from
``len(partial)`` down), re-read ``partial[k:]`` from the root, commit tokens on the way
where a byte cannot follow (a "split"), then read the byte. The weight of the result is
that of the hypothesis with its current token's path replaced by the new tokenization.

Each attempt needs the LM distribution after the committed token: it is materialized on
the fused path, together with the reads of every node the replay will visit.
"""

from __future__ import annotations

from genlm_fast.bytes.byte_lm.mass_rows import gather
from genlm_fast.bytes.byte_lm.materialize import materialize_states
from genlm_fast.bytes.byte_lm.trie_info import info_of
from genlm_fast.bytes.byte_lm.trie_state import LazyTrieState, check_byte
from genlm_fast.bytes.util import format_byte

__all__ = ["TokenHealer"]

NEG_INF = float("-inf")


def _walk_request(state, data):
    """Read request for the nodes a replay of ``data`` from ``state`` would visit."""
    children = state.children
    node = state.node
    nodes = [node, *children[node].values()]
    for b in data:
        node = children[node].get(b)
        if node is None:
            break
        nodes.extend(children[node].values())
    return (state._mass, nodes)


class TokenHealer:
    """Finds another tokenization of a hypothesis's current token that can read a byte.

    Args:
        max_backoff (int, optional): most bytes to back off (None: up to the whole token).
        max_splits (int, optional): most extra token boundaries in one attempt (None: any).
        verbose (bool): print each attempt.
    """

    def __init__(self, max_backoff=None, max_splits=None, verbose=False):
        for name, value in (("max_backoff", max_backoff), ("max_splits", max_splits)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} must be None or a non-negative int, got {value!r}")
        self.max_backoff = max_backoff
        self.max_splits = max_splits
        self.verbose = verbose

    def _log(self, message):
        if self.verbose:
            print(f"[heal] {message() if callable(message) else message}")

    async def try_heal(self, state, next_byte):
        """A state that has read ``partial`` and then ``next_byte`` under another
        tokenization, or None.

        Args:
            state (LazyTrieState): a materialized hypothesis. Only its ``trie``, ``node``,
                ``partial``, ``weight``, ``mass``, ``mode`` and ``lm_state`` are used (and
                ``terminated`` when it has one), so any object offering those will do.
            next_byte (int): the byte to read (0..255, or 257).
        """
        next_byte = check_byte(next_byte)
        if getattr(state, "terminated", False):
            return None  # nothing follows EOS
        partial = state.partial
        trie = state.trie.trie
        info = info_of(trie)
        root = info.root
        self._log(
            lambda: (
                f"Start: next_byte={format_byte(next_byte)}, "
                f"partial={bytes(partial)!r}, max_backoff={self.max_backoff}"
            )
        )
        # every node of the path and the token leaves under them, in one read
        children = info.children
        path = [root]
        for b in partial:
            nxt = children[path[-1]].get(b)
            if nxt is None:
                break
            path.append(nxt)
        wanted = [state.node]
        for node in path:
            wanted.append(node)
            wanted.extend(leaf for leaf, _ in info.eot_edges(node))
        row = state.mass
        gather([(row, wanted)])
        base = state.weight - (row[state.node] - row[root])  # the current token's path undone
        lowest = 0 if self.max_backoff is None else max(0, len(partial) - self.max_backoff)
        for k in range(len(partial), lowest - 1, -1):
            healed = await self._try_at_k(state, trie, base, k, next_byte)
            if healed is not None:
                return healed
        self._log("FAILED: no valid healing found")
        return None

    async def _try_at_k(self, state, trie, base, k, next_byte):
        """Commit ``state.partial[:k]`` as a token (each token spelling it), then replay."""
        info = info_of(trie)
        partial = state.partial
        children = info.children
        node = info.root
        for b in partial[:k]:
            node = children[node].get(b)
            if node is None:
                return None
        edges = info.eot_edges(node)
        if not edges:
            self._log(lambda: f"k={k}: no EOT at {bytes(partial[:k])!r}")
            return None
        for leaf, token_id in edges:
            healed = await self._try_eot_at_k(state, info, base, k, next_byte, leaf, token_id)
            if healed is not None:
                return healed
        return None

    async def _try_eot_at_k(self, state, info, base, k, next_byte, leaf, token_id):
        row = state.mass
        weight = base + (row[leaf] - row[info.root])
        token_id = int(token_id)
        replay = list(state.partial[k:]) + [next_byte]
        current = LazyTrieState(
            lm_state=state.lm_state << token_id,
            trie=state.trie,
            node=info.root,
            weight=weight,
            mode=state.mode,
        )
        await materialize_states([current], after=lambda: [_walk_request(current, replay)])
        if self.verbose:
            token = state.trie.trie.decode[token_id]
            self._log(f"k={k}: commit {bytes(token)!r} (token_id={token_id}), w={weight:.2f}")
        splits = 0
        for i, b in enumerate(replay):
            nxt = current << b
            if nxt is not None:
                current = nxt
                continue
            if self.max_splits is not None and splits >= self.max_splits:
                self._log(f"k={k}: hit max_splits={self.max_splits}")
                return None
            extensions = current.extend_all()
            if not extensions:
                self._log(f"k={k}: can't extend at {bytes(current.partial)!r}")
                return None
            splits += 1
            rest = replay[i:]
            await materialize_states(
                extensions,
                after=lambda exts=extensions, rest=rest: [_walk_request(e, rest) for e in exts],
            )
            for ext in extensions:
                self._log(f"k={k}: split #{splits}, w={ext.weight:.2f}")
                nxt = ext << b
                if nxt is not None:
                    current = nxt
                    break
            else:
                self._log(f"k={k}: couldn't consume {format_byte(b)} even after extend")
                return None
        self._log(f"SUCCESS at k={k}: w={current.weight:.2f}")
        return current
