"""What every genlm_fast trie shares: construction into a compiled layout, the lazily
built genlm-style attributes, input normalisation and the calls into ``genlm_fast.ops``.

The genlm.backend tries (``TokenCharacterTrie`` ...) and the genlm.bytes trie
(``TokenByteTrie``) differ only in how a vocabulary item becomes a path of edge keys,
in the keys of their leaf edges, and in what they return; they subclass ``CompiledTrie``.
"""

from __future__ import annotations

import gc
import numbers
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from functools import cached_property

import numpy as np
import torch

from genlm_fast.backend.tokenization.token import is_token
from genlm_fast.ops import dispatch
from genlm_fast.ops.layout import compile_layout
from genlm_fast.ops.layout_cache import load_cached, store_cached, vocab_digest
from genlm_fast.ops.trie_structure import build_structure


class CompiledTrie:
    """Base class: a trie over a vocabulary, numbered as genlm numbers it.

    Subclasses call ``_compile`` from their constructor. Reductions run through one
    dispatcher; ``kernel_backend`` ("auto", "reference", "triton", "cuda", "cpu") chooses
    the implementation and ``last_kernel_backend`` tells which one ran last.
    """

    kernel_backend: str = "auto"
    last_kernel_backend: str | None = None
    build_seconds: float = 0.0

    def _compile(
        self,
        words,
        leaf_keys,
        token_columns,
        *,
        eos_key=None,
        eos_positions=(),
        cache_key=None,
        cache=True,
        cache_dir=None,
    ):
        start = time.perf_counter()
        layout = None
        digest = None
        if cache and cache_key is not None:
            digest = vocab_digest(*cache_key)
            layout = load_cached(digest, cache_dir)
        if layout is None:
            parent, first, leaf_node, edge_key, eos_node = build_structure(
                words, leaf_keys, add_eos_node=eos_key is not None, eos_key=eos_key
            )
            layout = compile_layout(
                parent,
                first,
                leaf_node,
                token_columns,
                edge_key,
                eos_node,
                eos_positions=eos_positions,
            )
            if digest is not None:
                store_cached(digest, layout, cache_dir)
        self._layout = layout
        self.root = layout.root
        self.build_seconds = time.perf_counter() - start

    # ---------------------------------------------------------------- genlm attributes

    @property
    def layout(self):
        """The compiled ``TrieLayout`` the kernels read."""
        return self._layout

    @property
    def num_nodes(self) -> int:
        return self._layout.num_nodes

    @cached_property
    def children(self) -> list[dict]:
        """``children[node][edge_key] -> child``, in genlm's numbering and insertion order."""
        parent = self._layout.parent.tolist()
        edge_key = self._layout.edge_key
        with _gc_paused():
            children = [{} for _ in range(len(parent))]
            for node, p in enumerate(parent):
                if p >= 0:
                    children[p][self._public_key(edge_key[node])] = node
        return children

    def _public_key(self, key):
        """The key an edge of the layout has in ``children`` (the layout's own, here)."""
        return key

    @cached_property
    def jump(self) -> list[np.ndarray]:
        """Sorted child ids of every node (genlm's ``jump``)."""
        children = self.children
        with _gc_paused():
            return [np.array(sorted(kids.values()), dtype=np.int32) for kids in children]

    @cached_property
    def node2prefix(self) -> dict:
        """The path of edge keys from the root to every node (leaf edges add nothing)."""
        parent = self._layout.parent.tolist()
        edge_key = self._layout.edge_key
        letters = {}  # inner edge key -> the letters it adds
        prefix = [None] * self.num_nodes
        prefix[self.root] = []
        with _gc_paused():
            for node in range(self.num_nodes - 2, -1, -1):  # parents have larger ids
                key = edge_key[node]
                above = prefix[parent[node]]
                if is_leaf_key(key):
                    prefix[node] = above  # a leaf shares its parent's list, as in genlm
                    continue
                add = letters.get(key)
                if add is None:
                    add = letters[key] = self._edge_letters(key)
                prefix[node] = above + add
            return dict(enumerate(prefix))

    def prefix_of(self, node: int) -> list:
        """``node2prefix[node]``, computed for this node alone (a walk up to the root)."""
        parent, edge_key = self._layout.parent, self._layout.edge_key
        keys = []
        while node != self.root:
            keys.append(edge_key[node])
            node = int(parent[node])
        out = []
        for key in reversed(keys):
            if not is_leaf_key(key):
                out.extend(self._edge_letters(key))
        return out

    def _edge_letters(self, key) -> list:
        """The letters an inner edge adds to ``node2prefix`` (the key itself, here)."""
        return [key]

    @cached_property
    def leaf2word(self) -> dict:
        return {leaf: word for word, leaf in self.word2leaf.items()}

    # ---------------------------------------------------------------- reductions

    def _as_batch(self, ws, device) -> torch.Tensor:
        """A list / array / tensor of rows -> one ``[B, C]`` tensor (on ``device`` if given)."""
        ws = _as_sequence(ws)
        if isinstance(ws, torch.Tensor):
            dispatch.check_device(ws)  # before any copy to the trie's device
            batch = ws
        elif isinstance(ws, np.ndarray):
            if not ws.dtype.isnative:  # big-endian data: torch reads native order only
                ws = ws.astype(ws.dtype.newbyteorder("="))
            if any(stride < 0 for stride in ws.strides):  # a reversed view, e.g. ws[::-1]
                ws = ws.copy()
            batch = torch.from_numpy(ws)
        elif isinstance(ws, (list, tuple)):
            if len(ws) == 0:
                raise ValueError("empty batch: expected at least one weight row")
            if isinstance(ws[0], numbers.Real):  # one row of numbers
                try:
                    row = np.asarray(ws, dtype=np.float64)
                except TypeError:  # among them a 0-d tensor numpy cannot read (bfloat16)
                    row = np.asarray([float(w) for w in ws], dtype=np.float64)
                return self._as_batch(row, device)
            if all(getattr(w, "ndim", None) == 0 or isinstance(w, numbers.Real) for w in ws):
                # one row of 0-d tensors or arrays (list(tensor)), maybe among numbers
                if all(isinstance(w, torch.Tensor) for w in ws):  # in their own dtype
                    return self._as_batch(torch.stack(list(ws)), device)
                return self._as_batch(np.asarray([float(w) for w in ws]), device)
            rows = [self._as_batch(w, device) for w in ws]
            for i, r in enumerate(rows):
                if r.dim() != 2 or r.shape[0] != 1:
                    raise ValueError(
                        f"batch item {i} must be a 1-D weight vector, "
                        f"got shape {tuple(r.shape[1:]) if r.dim() == 2 else tuple(r.shape)}"
                    )
                if r.shape[1] != rows[0].shape[1]:
                    raise ValueError(
                        f"batch item {i} has length {r.shape[1]}, but item 0 has "
                        f"length {rows[0].shape[1]}"
                    )
            target = device if device is not None else rows[0].device
            return torch.cat([r.to(target) for r in rows], dim=0)
        if batch.dim() == 1:
            batch = batch.unsqueeze(0)
        if device is not None:
            batch = batch.to(device)
        return batch

    def _preprocess_ws(self, batch_ws) -> torch.Tensor:
        """genlm's batch preprocessing (its own test suites call it): rows (lists, arrays,
        tensors) -> one float32 ``[B, V]`` tensor on the trie's device."""
        batch = float_weights(self._as_batch(batch_ws, self.device)).to(torch.float32)
        if batch.shape[-1] != self._layout.num_columns:
            raise ValueError(
                f"expected weight rows of length {self._layout.num_columns}, got {batch.shape[-1]}"
            )
        return batch

    # genlm's sequential trie reads the first V entries of a longer weight row; its other
    # tries (matrix products) take exactly V
    _reads_first_columns = False

    def _weight_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """Weight rows as floats, cut to the vocabulary's width where the trie reads only
        its first columns (a row too short or too wide is left for the width check)."""
        batch = float_weights(batch)
        width = self._layout.num_columns
        if self._reads_first_columns and batch.dim() == 2 and batch.shape[1] > width:
            batch = batch[:, :width]
        return batch

    def _reduce(self, ws, reduction, mode="without_eos", device=None, dtype=None):
        batch = self._as_batch(ws, device)
        if reduction != "log_mass":
            batch = self._weight_rows(batch)
        # dtype: the result's. float64 needs no float64 copy of the input: the dispatcher
        # gives float64 results of float32 values (the same numbers, the conversion being
        # exact). float32 rounds the values first, as genlm's float32 tries do.
        wide = dtype == torch.float64
        if dtype is not None and not wide:
            batch = batch.to(dtype)
        # weight rows hold one entry per token id, exactly; logit rows may be wider (padding)
        width = None if reduction == "log_mass" else self._layout.num_columns
        out, used = dispatch.trie_reduce(
            batch,
            self._layout,
            reduction,
            mode=mode,
            backend=self.kernel_backend,
            exact_width=width,
            float64_result=wide,
        )
        self.last_kernel_backend = used
        return out

    @property
    def vocab_size(self) -> int:
        return len(self._layout.token_column)

    def batch_log_mass(self, logits, mode=None) -> torch.Tensor:
        """Log of the softmax mass of every node, fused: ``[B, V']`` logits -> ``[B, N]``.

        Logits may be float32/float16/bfloat16 on any device and wider than the
        vocabulary (model padding: the softmax runs over the whole row). The result is
        float32 on the logits' device.
        """
        mode_name = self._mode_name(mode)
        logits = _as_sequence(logits)
        if _ndim(logits) != 2:
            raise ValueError(
                f"batch_log_mass expects [batch, vocab] logits, got {_describe(logits)}"
            )
        return self._reduce(logits, "log_mass", mode_name)

    def log_mass(self, logits, mode=None) -> torch.Tensor:
        """``batch_log_mass`` for one ``[V']`` logit row; returns ``[N]``."""
        logits = one_row(
            logits, "log_mass expects one [vocab] logit row", "use batch_log_mass for a batch"
        )
        return self._reduce(logits, "log_mass", self._mode_name(mode))[0]

    def _mode_name(self, mode) -> str:
        """The layout mode for ``mode``: a trie without an EOS node has only "without_eos"
        (given as None, the string or an enum member with that value)."""
        value = getattr(mode, "value", mode)
        if mode is None or isinstance(value, str) and value == "without_eos":
            return "without_eos"
        raise ValueError(
            f"unknown trie mode {mode!r} for {type(self).__name__}, which has no "
            "EOS node: expected None or 'without_eos'"
        )

    # ---------------------------------------------------------------- display

    def visualize(self, ws=None):
        """A graphviz ``Digraph`` of the trie, optionally labelled with per-node weights."""
        try:
            import graphviz
        except ImportError as e:
            raise ImportError(
                "visualize() needs the graphviz package: pip install graphviz (or genlm_fast[viz])"
            ) from e
        if ws is not None:
            ws = np.asarray(ws.detach().cpu() if isinstance(ws, torch.Tensor) else ws)
            if len(ws) != self.num_nodes:
                raise ValueError(
                    f"weight vector has length {len(ws)}, the trie has {self.num_nodes} nodes"
                )
        dot = graphviz.Digraph(comment="genlm_fast trie")
        dot.attr(rankdir="LR")
        peak = float(ws.max()) if ws is not None else 0.0
        for node in range(self.num_nodes):
            label = f"{node}\n{self.node2prefix[node]!r}"
            fill = "#ffffff"
            if ws is not None:
                label += f"\n{float(ws[node]):.4f}"
                if peak > 0:
                    shade = int(255 * (1 - max(0.0, float(ws[node])) / peak))
                    fill = f"#{shade:02x}ff{shade:02x}"
            shape = "doublecircle" if node in self.leaf2word else "circle"
            dot.node(str(node), label, shape=shape, style="filled", fillcolor=fill)
        edge_key = self._layout.edge_key
        for node, kids in enumerate(self.children):
            for key, child in kids.items():
                own = edge_key[child]
                text = f"end of token {own[1]}" if is_leaf_key(own) else str(key)
                dot.edge(str(node), str(child), label=text)
        return dot


def as_vocabulary(decode):
    """A trie's vocabulary as a sequence: a generator or any other one-pass iterable of
    tokens is read into a list once (the trie reads it more than once); None, a sequence
    or an array stays as it is."""
    if decode is None or isinstance(decode, (Sequence, np.ndarray)):
        return decode
    if isinstance(decode, Iterable) and not isinstance(decode, (str, bytes)):
        return list(decode)
    raise TypeError(f"decode must be a list of tokens, got {type(decode).__name__}")


def _as_sequence(ws):
    """Weights as a tensor, an array, a list or a tuple (those stay as they are): an object
    numpy can read (``__array__``) becomes an array, any other iterable of rows (a
    generator, a deque, ``dict.values()``; genlm loops over the batch) a list."""
    if isinstance(ws, (torch.Tensor, np.ndarray, list, tuple)):
        return ws
    if hasattr(ws, "__array__"):
        return np.asarray(ws)
    if isinstance(ws, Iterable) and not isinstance(ws, (str, bytes, bytearray, dict)):
        return list(ws)
    raise TypeError(
        f"expected weights as a torch.Tensor, a numpy array or a list of "
        f"rows, got {type(ws).__name__}"
    )


@contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector while hundreds of thousands of small containers
    without cycles are built: the collections their allocations trigger cost more than the
    building (node2prefix for Llama-3's vocabulary)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def float_weights(batch: torch.Tensor) -> torch.Tensor:
    """Weights as floats: integer and bool weights (counts, masks) become float64 and the
    8-bit floats float32, exactly, as genlm takes them; the kernels' float dtypes stay as
    they are; complex weights are an error."""
    if batch.dtype in dispatch.FLOAT_DTYPES:
        return batch
    if batch.is_floating_point():
        return batch.to(torch.float32)
    if not batch.is_complex():
        return batch.to(torch.float64)
    raise TypeError(f"expected real (float, integer or bool) weights, got {batch.dtype}")


def trie_device(device) -> str:
    """A trie's device from its ``device`` argument: "cpu", "cuda" or None (cuda when
    available)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device) not in ("cpu", "cuda"):
        raise ValueError(f"Invalid device: {device!r}. Must be 'cpu', 'cuda' or None")
    return str(device)


def _ndim(ws) -> int:
    """Dimensions of a tensor, an array or a (nested) list of numbers."""
    if hasattr(ws, "ndim"):
        return ws.ndim
    if (
        isinstance(ws, (list, tuple))
        and ws
        and (hasattr(ws[0], "ndim") or isinstance(ws[0], (list, tuple)))
    ):
        return 1 + _ndim(ws[0])
    return 1


def _describe(ws) -> str:
    shape = getattr(ws, "shape", None)
    if shape is not None:
        return f"shape {tuple(shape)}"
    return f"a {_ndim(ws)}-D nested {type(ws).__name__} of length {len(ws)}"


def one_row(
    ws,
    expected="expected one weight vector of shape [V]",
    hint="use the batch_ methods for a batch",
):
    """Reject anything but one row (``[V]``): a batch, a scalar or a nested list. Returns
    the row (a one-pass iterable read into a list, so that a batch in that form is seen)."""
    ws = _as_sequence(ws)
    if _ndim(ws) != 1:
        raise ValueError(f"{expected}, got {_describe(ws)}; {hint}")
    return ws


def is_leaf_key(key) -> bool:
    """Whether a layout edge key ends a token: those are ``(None, i)`` (genlm.backend's
    leaf keys; the byte trie swaps in its sentinel for ``children``)."""
    return isinstance(key, tuple) and len(key) > 0 and key[0] is None


def token_fields(item):
    """``(bytes, token_id)`` of a token (``is_token``: genlm_fast's or genlm's ``Token``),
    or None for anything else."""
    if is_token(item):
        return bytes(item), item.token_id
    return None


def item_entry(item):
    """How the genlm.backend tries read a vocabulary item: the edge keys spelling it, its
    key in ``word2leaf`` (``(bytes, token_id)`` for a token, else the item) and whether it
    is plain bytes."""
    fields = token_fields(item)
    if fields is not None:
        return fields[0], fields, False
    if isinstance(item, bytes):
        return item, item, True
    if isinstance(item, Iterable):
        return item, item, False
    raise TypeError(
        f"vocabulary items must be Token, bytes or iterable, got {type(item).__name__}: {item!r}"
    )
