"""``LazyTrieState``: one hypothesis of the byte-level beam, and the fused materialization.

A state is a token context (``StatefulTokenizedLM``) plus a position in the byte trie (the
bytes of a token not yet committed). Its weight is the log-probability of the bytes read so
far along this tokenization. Reading the next byte only needs the log-mass of the trie
nodes around the current position: the current node and its children (and, for token
healing, the nodes of its path). The log-mass of every node is a function of the LM's
next-token distribution after the context; computing it is "materializing" the state.

The fused path (``materialize_states``):

* every state that needs it in a step is materialized together: distinct contexts go to
  the LM in ONE ``batch_next_token_logits`` call, and its rows go to the trie's
  ``batch_log_mass`` in ONE kernel launch per trie mode (one mode in a beam);
* the ``[B, N]`` log-masses stay on the LM's device, copied into a per-trie device pool
  (``_MassPool``) whose rows are recycled when the last state using one is dropped;
* states read their nodes in place when the pool is in host memory (a step's next-byte
  distribution is one indexed read of its row); from a device pool through ``_gather``: the
  nodes every state of the beam is missing are fetched with ONE ``index_select`` on the pool
  and ONE device-to-host transfer, and values already read are kept on the host (per pool
  row, shared by every state on it).

No state ever copies a full ``[N]`` row to the host (``state.mass`` still can, explicitly:
``np.asarray(state.mass)``).

Lookahead: a beam step that reads a known byte (``beam << b``) knows which tokens the
hypotheses of the next step could commit. When it calls the LM anyway and the batch stays
small, those contexts ride along; their logits wait (on the device, no kernel run) in
``_TrieInfo.logits_memo``, so a prefill needs an LM call only every other byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import weakref
from collections import OrderedDict
from functools import cached_property

import numpy as np
import torch

from genlm_fast.bytes.byte_lm.lm_state import StatefulTokenizedLM
from genlm_fast.bytes.trie import (
    EOS,
    AsyncTokenByteTrie,
    TokenByteTrie,
    TrieMode,
    as_mode,
)
from genlm_fast.bytes.util import (
    EOT_INDEX,
    NUM_SYMBOLS,
    LazyByteProbs,
    as_index,
    escape,
)

__all__ = ["EOS", "LazyTrieState", "TrieMode", "check_byte", "fused_stats", "materialize_states"]

NEG_INF = -math.inf
LOOKAHEAD_ROWS = 64  # most logit rows computed ahead of need kept per trie
# Largest LM batch (rows needed now + rows computed ahead) that may carry lookahead rows.
# Past it, the extra rows (often two new tokens each, which pads every row of the batch to
# two positions) cost more than the LM call they can save: on a CPU a forward pass is
# cheap in its first rows only; on a GPU rows are almost free.
LOOKAHEAD_MAX_BATCH = {"cpu": 16, "cuda": 128}


def _weakly_referable(obj):
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _lookahead_limit(model):
    device = getattr(model, "device", None)
    kind = getattr(device, "type", str(device) if device is not None else "cpu")
    return LOOKAHEAD_MAX_BATCH.get(kind, LOOKAHEAD_MAX_BATCH["cpu"])


def check_byte(b) -> int:
    """``b`` as an int in 0..255, or 257 (EOS); TypeError / ValueError otherwise. 256 (the
    end-of-token slot of next-byte distributions) is not a byte one can append."""
    hint = " (use b[0] or ord(c) for a single byte)" if isinstance(b, (bytes, str)) else ""
    value = as_index(b, "a byte must be an int in 0..255, or 257 for EOS", hint)
    if not (0 <= value < 256 or value == EOS):
        what = " (256 is the end-of-token slot, not a byte)" if value == 256 else ""
        raise ValueError(f"byte {value} is out of range: expected 0..255, or 257 for EOS{what}")
    return value


# --------------------------------------------------------------------------- per-trie data


def model_key(model):
    """What results computed from ``model`` are remembered under: its identity and its
    ``state_epoch``, which genlm_fast's LMs move whenever calls without ``lora_name`` may
    start giving other answers (the default adapter changed, clear_cache())."""
    return id(model), getattr(model, "state_epoch", 0)


class _TrieInfo:
    """What the states of one trie share: structure, device pools, memo of rows, counters.

    Kept in a WeakKeyDictionary keyed by the trie, so it holds no reference to the trie.
    """

    def __init__(self, trie):
        self.children = trie.children
        self.root = trie.root
        self.eos_node = trie.eos_node
        self.eot_sentinel = trie.eot_sentinel
        self.num_nodes = int(trie.layout.num_nodes)
        self._edge_arrays = {}  # node -> edge_arrays(node), or False
        self.pools = {}
        # (model_key(model), mode, context) -> _Row while some state uses that row
        self.memo = weakref.WeakValueDictionary()
        # (model_key(model), context) -> (weakref to model, logits row): contexts computed ahead of
        # need (see ``materialize_states``), consumed by the first materialization using them
        self.logits_memo = OrderedDict()
        self.stats = {
            "lm_batches": 0,
            "lm_rows": 0,
            "kernel_launches": 0,
            "gathers": 0,
            "gathered_values": 0,
            "memo_hits": 0,
            "lookahead_rows": 0,
            "lookahead_hits": 0,
        }

    def take_logits(self, model, ctx):
        entry = self.logits_memo.pop((model_key(model), ctx), None)
        if entry is not None and entry[0]() is model:
            return entry[1]
        return None

    def keep_logits(self, model, ctx, row, key_model):
        """Keep ``row``, the logits of ``ctx``, under ``key_model``: the model's key
        (``model_key``) when the row was asked for."""
        try:
            ref = weakref.ref(model)
        except TypeError:  # a model that cannot be weakly referenced: no lookahead
            return
        memo = self.logits_memo
        key = (key_model, ctx)
        memo[key] = (ref, row)
        memo.move_to_end(key)
        while len(memo) > LOOKAHEAD_ROWS:
            memo.popitem(last=False)

    def pool(self, device):
        key = str(device)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = _MassPool(self.num_nodes, torch.device(device), self.stats)
        return pool

    def edge_arrays(self, node):
        """The edges out of ``node`` as index arrays, in the children's order: (bytes,
        their child nodes, the end-of-token leaves); None when an edge is keyed by anything
        else (logp_next then names it)."""
        got = self._edge_arrays.get(node)
        if got is None:
            keys, kids, eots = [], [], []
            for key, child in self.children[node].items():
                if isinstance(key, tuple):
                    eots.append(child)
                elif isinstance(key, (int, np.integer)):
                    keys.append(int(key))
                    kids.append(child)
                else:
                    got = False
                    break
            else:
                got = tuple(np.array(a, dtype=np.intp) for a in (keys, kids, eots))
            self._edge_arrays[node] = got
        return got or None

    def eot_edges(self, node):
        sentinel = self.eot_sentinel
        return [
            (child, key[1])
            for key, child in self.children[node].items()
            if isinstance(key, tuple) and key[0] == sentinel
        ]


_INFOS = weakref.WeakKeyDictionary()


def _info_of(trie) -> _TrieInfo:
    info = _INFOS.get(trie)
    if info is None:
        info = _INFOS[trie] = _TrieInfo(trie)
    return info


def fused_stats(obj) -> dict:
    """Counters of the fused path for the trie of ``obj`` (a state, beam or trie).

    ``lm_batches`` (LM calls), ``lm_rows`` (contexts sent), ``kernel_launches``
    (``batch_log_mass`` calls), ``gathers`` (index_select + device-to-host transfers),
    ``gathered_values`` (floats transferred), ``memo_hits`` (rows reused).
    """
    states = getattr(obj, "states", None)
    if states is not None:
        if not states:
            raise ValueError("an empty beam has no trie to report on")
        obj = states[0]
    trie = getattr(obj, "trie", obj)
    trie = getattr(trie, "trie", trie)
    return _info_of(trie).stats


# --------------------------------------------------------------------------- device pool


class _MassPool:
    """Log-masses ``[capacity, N]`` on one device; one row per materialized (context, mode)."""

    def __init__(self, num_nodes, device, stats):
        self.num_nodes = num_nodes
        self.device = device
        self.stats = stats
        self.data = None
        self.capacity = 0
        self.free = []
        self.live = 0
        self._busy = 0
        self._host = None  # (data, its numpy view) for a pool in host memory

    def store(self, masses, model):
        """Copy ``[B, N]`` masses into free rows; returns one ``_Row`` per input row."""
        count = int(masses.shape[0])
        self._busy += 1
        try:
            if len(self.free) < count:
                self._grow(count - len(self.free))
            slots = [self.free.pop() for _ in range(count)]
            self.live += count
            try:
                data = self.data
                index = torch.tensor(slots, dtype=torch.long, device=data.device)
                data.index_copy_(0, index, masses.to(device=data.device, dtype=data.dtype))
            except BaseException:
                self.free.extend(slots)
                self.live -= count
                raise
        finally:
            self._busy -= 1
        return [_Row(self, slot, model) for slot in slots]

    def host_array(self):
        """``data`` as a numpy array, for a pool in host memory (a view, no copy)."""
        if self._host is None or self._host[0] is not self.data:
            self._host = (self.data, self.data.numpy())
        return self._host[1]

    def _grow(self, extra):
        old = self.capacity
        new = max(2 * old, old + extra, 8)
        data = torch.empty((new, self.num_nodes), dtype=torch.float32, device=self.device)
        if self.data is not None and old:
            data[:old].copy_(self.data)
        self.data = data
        self.free.extend(range(new - 1, old - 1, -1))  # low slots are handed out first
        self.capacity = new

    def release(self, slot):
        self.free.append(slot)
        self.live -= 1
        if self.live == 0 and not self._busy:  # nothing left: give the memory back
            self.data = None
            self._host = None
            self.capacity = 0
            self.free = []


class _Row(np.lib.mixins.NDArrayOperatorsMixin):
    """One pool row (the log-masses of one materialized state) and the values read so far.

    Indexing with a node id returns that node's log-mass (fetched if not read yet). Used as
    the float32 array genlm-bytes keeps (``np.asarray(row)``, ``row - 1``, ``np.exp(row)``,
    ``row.max()``, ``row.tolist()``, ...), it copies the whole row to the host first: only
    when asked for.
    """

    __slots__ = ("__weakref__", "model", "pool", "slot", "values")

    def __init__(self, pool, slot, model):
        self.pool = pool
        self.slot = slot
        # read so far (a device pool); a pool in host memory is read in place
        self.values = _PoolValues(pool, slot) if pool.device.type == "cpu" else {}
        self.model = model  # keeps id(model) in memo keys unambiguous

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)) and not isinstance(idx, bool):
            node = int(idx)
            if node < 0:
                node += self.pool.num_nodes
            if not 0 <= node < self.pool.num_nodes:
                raise IndexError(
                    f"node {idx} is out of range for a trie of {self.pool.num_nodes} nodes"
                )
            value = self.values.get(node)
            if value is None:
                _gather([(self, (node,))])
                value = self.values[node]
            return value
        return self.numpy()[idx]

    def numpy(self):
        """The whole row as a float32 array on the host (a full transfer)."""
        return self.pool.data[self.slot].detach().cpu().numpy().copy()

    @property
    def tensor(self):
        """A copy of the row on its device."""
        return self.pool.data[self.slot].clone()

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(x.numpy() if isinstance(x, _Row) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getattr__(self, name):
        # what a numpy array has and this row does not (max, sum, tolist, astype, ...): the
        # array's, on a host copy
        if name.startswith("_") or not hasattr(np.ndarray, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.numpy(), name)

    dtype = np.dtype(np.float32)
    ndim = 1

    def __len__(self):
        return self.pool.num_nodes

    @property
    def shape(self):
        return (self.pool.num_nodes,)

    def __repr__(self):
        return (
            f"<log-masses of {self.pool.num_nodes} trie nodes on {self.pool.device}, "
            f"{len(self.values)} read>"
        )

    def __del__(self):
        pool = self.pool
        if pool is not None:
            with contextlib.suppress(Exception):  # interpreter shutdown
                pool.release(self.slot)


class _ArrayValues:
    """``values`` of a host row: every node is available."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __getitem__(self, node):
        return float(self.array[node])

    get = __getitem__

    def __contains__(self, node):
        return True

    def take(self, nodes):
        """The values of ``nodes`` (an index array), as float64."""
        return np.asarray(self.array[nodes], dtype=np.float64)


class _PoolValues(_ArrayValues):
    """``values`` of a row of a pool in host memory: read in place, nothing to gather. (The
    pool's array is looked up at each read: growing the pool moves it.)"""

    __slots__ = ("pool", "slot")

    def __init__(self, pool, slot):
        self.pool = pool
        self.slot = slot

    @property
    def array(self):
        return self.pool.host_array()[self.slot]


class _HostRow:
    """A log-mass vector given by the caller (numpy / tensor), used as is."""

    __slots__ = ("__weakref__", "array", "values")
    pool = None

    def __init__(self, array):
        self.array = array
        self.values = _ArrayValues(array)

    def __getitem__(self, idx):
        return self.array[idx]

    def numpy(self):
        return np.array(self.array)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.array, dtype=dtype)

    def __len__(self):
        return len(self.array)

    @property
    def shape(self):
        return self.array.shape


def _as_row(mass):
    if mass is None or isinstance(mass, (_Row, _HostRow)):
        return mass
    if isinstance(mass, torch.Tensor):
        mass = mass.detach().cpu().numpy()
    array = np.asarray(mass)
    if array.ndim != 1:
        raise ValueError(f"mass must be one value per trie node (1-D), got shape {array.shape}")
    return _HostRow(array)


def _gather(requests):
    """Read the listed nodes of each row: one index_select + one transfer per device.

    ``requests``: pairs ``(row, nodes)``; nodes already read are skipped, host rows need
    nothing. In a beam all rows live in one pool, hence one transfer.
    """
    wanted = {}
    for row, nodes in requests:
        values = row.values
        if not isinstance(values, dict):  # a row in host memory: read in place
            continue
        pool = row.pool
        base = row.slot * pool.num_nodes
        for node in nodes:
            if node not in values:
                entry = wanted.get(pool)
                if entry is None:
                    entry = wanted[pool] = {}
                entry[base + node] = (row, node)
    for pool, entry in wanted.items():
        flat = list(entry)
        index = torch.tensor(flat, dtype=torch.long)
        if pool.device.type != "cpu":
            index = index.to(pool.device, non_blocking=True)
        got = pool.data.view(-1).index_select(0, index).tolist()
        for f, value in zip(flat, got):
            row, node = entry[f]
            row.values[node] = value
        pool.stats["gathers"] += 1
        pool.stats["gathered_values"] += len(flat)


# --------------------------------------------------------------------------- materialization


async def _next_token_logits(model, contexts):
    """``[B, V']`` scores of each context: logits (up to a constant) when the model offers
    them, else log-probabilities."""
    fn = getattr(model, "batch_next_token_logits", None)
    if fn is None:
        fn = getattr(model, "batch_next_token_logprobs", None)
    if fn is not None:
        out = await fn(contexts)
    else:
        out = torch.stack(await asyncio.gather(*(model.next_token_logprobs(c) for c in contexts)))
    if not isinstance(out, torch.Tensor):
        out = torch.as_tensor(np.asarray(out))
    if out.dim() == 1:
        out = out.unsqueeze(0)
    if out.dim() != 2 or out.shape[0] != len(contexts):
        raise RuntimeError(
            f"the language model returned scores of shape {tuple(out.shape)} "
            f"for {len(contexts)} contexts"
        )
    return out


async def _materialize_group(states, trie, info, lookahead=()):
    """Materialize states sharing one model and trie: one LM call, one kernel per mode.

    Contexts whose logits were computed ahead (``info.logits_memo``) skip the LM. When the
    LM is called anyway, the ``lookahead`` contexts join its batch and their logits are
    kept for later (no kernel runs on them now).
    """
    model = states[0].lm_state.model
    key_model = model_key(model)
    modes_of = {}  # context -> modes needed, in first-seen order
    todo = []
    for s in states:
        ctx = tuple(s.lm_state.context)
        row = info.memo.get((key_model, s.mode, ctx))
        if row is not None and row.model is model:
            s._mass = row
            info.stats["memo_hits"] += 1
            continue
        modes = modes_of.setdefault(ctx, [])
        if s.mode not in modes:
            modes.append(s.mode)
        todo.append((s, ctx))
    if not todo:
        return
    contexts = list(modes_of)
    rows_of = {}  # context -> logits row
    for ctx in contexts:
        row = info.take_logits(model, ctx)
        if row is not None:
            rows_of[ctx] = row
            info.stats["lookahead_hits"] += 1
    missing = [c for c in contexts if c not in rows_of]
    fresh = None  # the LM's output, when it holds the rows in ``contexts`` order
    remember = True  # whether rows computed now may be reused later (memo, lookahead)
    if missing:
        extra = []
        seen = set(contexts)
        for ctx in lookahead:
            if ctx not in seen and (key_model, ctx) not in info.logits_memo:
                seen.add(ctx)
                extra.append(ctx)
        if extra and (
            len(missing) + len(extra) > _lookahead_limit(model) or not _weakly_referable(model)
        ):
            extra = []  # all or nothing: a partial lookahead rarely saves the next call
        logits = await _next_token_logits(model, [list(c) for c in missing + extra])
        # The default adapter may have changed while the batch was in flight (set_lora /
        # clear_lora / clear_cache from another task): then which one computed these rows
        # is not known, and they must not be remembered under either key.
        remember = model_key(model) == key_model
        info.stats["lm_batches"] += 1
        info.stats["lm_rows"] += len(missing) + len(extra)
        for i, ctx in enumerate(missing):
            rows_of[ctx] = logits[i]
        if len(missing) == len(contexts):
            fresh = logits
        if extra and remember:
            ahead = logits[len(missing) :].clone()  # own storage: the batch can go
            for ctx, row in zip(extra, ahead):
                info.keep_logits(model, ctx, row, key_model)
            info.stats["lookahead_rows"] += len(extra)
    by_mode = {}
    for i, ctx in enumerate(contexts):
        for mode in modes_of[ctx]:
            by_mode.setdefault(mode, []).append(i)
    rows = {}
    for mode, idx in by_mode.items():
        if fresh is not None and len(idx) == len(contexts):
            block = fresh[: len(contexts)]  # no copy
        else:
            block = torch.stack([rows_of[contexts[i]] for i in idx])
        masses = trie.batch_log_mass(block, mode)
        info.stats["kernel_launches"] += 1
        pool = info.pool(masses.device)
        for i, row in zip(idx, pool.store(masses, model)):
            rows[(contexts[i], mode)] = row
            if remember:
                info.memo[(key_model, mode, contexts[i])] = row
    for s, ctx in todo:
        if s._mass is None:
            s._mass = rows[(ctx, s.mode)]
            s.lm_state._n_calls += 1


def batchable(lm_state):
    """Whether ``lm_state`` exposes its model and context (as ``StatefulTokenizedLM`` does)."""
    return hasattr(lm_state, "model") and hasattr(lm_state, "context")


async def _materialize_alone(state):
    """Materialize a state whose LM state offers only ``logp_next()`` (e.g. a test double):
    its log-probabilities go through the fused kernel on their own."""
    logp = await state.lm_state.logp_next()
    logp = logp if isinstance(logp, torch.Tensor) else torch.as_tensor(np.asarray(logp))
    masses = state.trie.trie.batch_log_mass(logp.reshape(1, -1), state.mode)
    state._mass = _as_row(masses[0])


async def materialize_states(states, extra=(), after=None, lookahead=()):
    """Materialize ``states`` together and read the nodes each of them needs next.

    The states without masses are grouped by (model, trie); each group costs one LM batch
    (none when every context is already known) and one ``batch_log_mass`` launch. Then every
    state's current node and its children, plus the ``extra`` requests and those returned
    by ``after()`` (called once the states have their masses), are read in one gather.

    Args:
        states (list[LazyTrieState]): states to materialize (already materialized ones
            only get their nodes read).
        extra (iterable): ``(row, nodes)`` read requests for other states.
        after (callable, optional): returns more requests once the masses exist.
        lookahead (iterable): ``(model, context)`` pairs likely to be materialized next;
            if a group calls its LM anyway, they ride along in its batch and their logits
            are kept (a later materialization of those contexts then needs no LM call).
    """
    pending = [s for s in states if s._mass is None]
    for s in [s for s in pending if not batchable(s.lm_state)]:
        await _materialize_alone(s)
    pending = [s for s in pending if s._mass is None]
    if pending:
        groups = {}
        for s in pending:
            inner = s.trie.trie
            groups.setdefault((id(s.lm_state.model), id(inner)), (inner, []))[1].append(s)
        ahead = {}
        for model, ctx in lookahead:
            ahead.setdefault(id(model), []).append(tuple(ctx))
        for (model_id, _), (inner, group) in groups.items():
            await _materialize_group(group, inner, group[0]._info, ahead.get(model_id, ()))
    requests = list(extra)
    requests.extend(s._view_request() for s in states if s._mass is not None)
    if after is not None:
        requests.extend(after())
    _gather(requests)
    return states


def _as_async_trie(trie):
    if isinstance(trie, AsyncTokenByteTrie):
        return trie
    if isinstance(trie, TokenByteTrie):
        return AsyncTokenByteTrie(trie)
    inner = getattr(trie, "trie", None)
    if inner is not None and hasattr(inner, "batch_log_mass") and hasattr(inner, "layout"):
        return trie
    raise TypeError(
        f"LazyTrieState needs a genlm_fast AsyncTokenByteTrie (or TokenByteTrie), "
        f"got {type(trie).__module__}.{type(trie).__name__}"
    )


# --------------------------------------------------------------------------- the state


class LazyTrieState:
    """A position in the byte trie under a token context, with a log-weight.

    Args:
        lm_state (StatefulTokenizedLM): the committed tokens.
        trie (AsyncTokenByteTrie): the byte trie of the model's vocabulary.
        node (int): the current trie node (the bytes of the token being read).
        weight (float): log-probability of every byte read so far along this path.
        mass (optional): the log-masses of the trie nodes under this context: normally set
            by materialization (a device-resident row); a 1-D array is also accepted.
        mode (TrieMode): how EOS tokens count (``WITH_EOS``: towards the EOS node only).
        terminated (bool): whether EOS was read.
    """

    def __init__(
        self, lm_state, trie, node, weight, mass=None, mode=TrieMode.WITH_EOS, terminated=False
    ):
        self.lm_state = lm_state
        self.trie = _as_async_trie(trie)
        self._info = _info_of(self.trie.trie)
        self.node = node
        self.weight = weight
        self._mass = _as_row(mass)
        self._extend = None
        self.mode = as_mode(mode)
        self.root = self._info.root
        self.children = self._info.children
        self.terminated = terminated

    @classmethod
    def initial(cls, lm, trie, mode=TrieMode.WITH_EOS):
        """The root state after the tokenizer's BOS token, with weight 0."""
        trie = _as_async_trie(trie)
        return cls(
            lm_state=StatefulTokenizedLM.initial(lm),
            trie=trie,
            node=trie.trie.root,
            weight=0.0,
            mode=mode,
        )

    # ---------------------------------------------------------------- reading

    @property
    def partial(self):
        """The bytes of the current node (those of the token being read), as a list."""
        return self.trie.trie.prefix_of(self.node)

    @property
    def mass(self):
        """Log-mass of every trie node under this context, indexable by node id.

        Reads are served from the device row, a node at a time (``np.asarray`` copies all).

        Raises:
            ValueError: the state was not materialized yet.
        """
        if self._mass is None:
            raise ValueError("State is not yet materialized.")
        return self._mass

    @property
    def is_materialized(self):
        return self._mass is not None

    def _view_request(self):
        return (self._mass, (self.node, *self.children[self.node].values()))

    def _ensure_view(self):
        _gather([self._view_request()])

    def with_mode(self, mode):
        """The same state under another trie mode (its masses, if any, are kept)."""
        return LazyTrieState(
            lm_state=self.lm_state,
            trie=self.trie,
            node=self.node,
            weight=self.weight,
            mass=self._mass,
            mode=mode,
            terminated=self.terminated,
        )

    def actions(self):
        """Edges out of the current node: byte -> child, EOS, and end-of-token leaves."""
        return self.children[self.node]

    def get_all_EOT(self):
        """``[(leaf_node, token_id), ...]``: the tokens that end at the current node."""
        return self._info.eot_edges(self.node)

    def get_EOT(self):
        """The first end-of-token leaf of the current node, or None (older genlm API)."""
        edges = self.get_all_EOT()
        return edges[0][0] if edges else None

    def __lshift__(self, b):
        """The state after reading byte ``b``, or None if the trie has no such edge here
        (or the state already read EOS)."""
        b = check_byte(b)
        if self.terminated:
            return None
        child = self.children[self.node].get(b)
        if child is None:
            return None
        row = self.mass
        here, there = row[self.node], row[child]
        weight = NEG_INF if there == NEG_INF else self.weight + there - here
        return LazyTrieState(
            lm_state=self.lm_state,
            trie=self.trie,
            node=child,
            weight=weight,
            mass=row,
            mode=self.mode,
            terminated=b == EOS,
        )

    def extend_all(self):
        """Commit the token ending here: one new root state per token id that ends here
        (several when distinct tokens share these bytes). Cached."""
        if self._extend is None:
            protos = self._extension_protos()
            self._finish_extensions(protos)
        return self._extend

    def extend(self):
        """The first of ``extend_all()``, or None (older genlm API)."""
        out = self.extend_all()
        return out[0] if out else None

    def _extension_protos(self):
        """The extensions with their contexts but no weight yet (no mass needed)."""
        return [
            (
                leaf,
                LazyTrieState(
                    lm_state=self.lm_state << int(token_id),
                    trie=self.trie,
                    node=self.root,
                    weight=math.nan,
                    mode=self.mode,
                ),
            )
            for leaf, token_id in self.get_all_EOT()
        ]

    def _finish_extensions(self, protos):
        if self._extend is not None:
            return
        if protos:
            row = self.mass
            here = row[self.node]
            for leaf, state in protos:
                there = row[leaf]
                state.weight = NEG_INF if there == NEG_INF else self.weight + there - here
        self._extend = [state for _, state in protos]

    @cached_property
    def logp_next(self):
        """``LazyByteProbs`` of the next symbol given this state: bytes, EOT (256), EOS."""
        row = self.mass
        self._ensure_view()
        values = row.values
        logps = np.full(NUM_SYMBOLS, NEG_INF)
        z = values[self.node]
        if z == NEG_INF:
            return LazyByteProbs(logps)
        edges = None if isinstance(values, dict) else self._info.edge_arrays(self.node)
        if edges is not None:  # a row in host memory: the same arithmetic, array-wise
            keys, kids, eots = edges
            logps[keys] = values.take(kids) - z
            if len(eots):
                eot = values.take(eots) - z
                logps[EOT_INDEX] = eot[0] if len(eot) == 1 else np.logaddexp.reduce(eot)
            return LazyByteProbs(logps)
        eot = []
        for key, child in self.children[self.node].items():
            v = values[child] - z
            if isinstance(key, tuple):
                eot.append(v)
            elif isinstance(key, (int, np.integer)):
                logps[key] = v
            else:
                raise ValueError(  # noqa: TRY004 - the error genlm-bytes raises here
                    f"unexpected edge key {key!r} ({type(key).__name__}): a byte-level "
                    "state needs byte edges (no atomic byte strings)"
                )
        if eot:
            logps[EOT_INDEX] = eot[0] if len(eot) == 1 else np.logaddexp.reduce(eot)
        return LazyByteProbs(logps)

    async def materialize(self):
        """Compute this state's masses (an LM call and a kernel launch); returns self."""
        await materialize_states([self])
        return self

    def __repr__(self):
        partial = self.partial
        text = escape(bytes(b for b in partial if isinstance(b, int) and 0 <= b <= 255))
        tail = "<EOS>" if self.terminated else ""
        return f"{self.weight:.2f}: {self.lm_state}|{text}{tail}"

    async def cleanup(self):
        """Stop the trie's background task (the trie stays usable)."""
        await self.trie.cleanup()
