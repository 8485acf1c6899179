"""Where the log-masses of materialized states live, and how their nodes are read.

The ``[B, N]`` log-masses a fused materialization computes (see ``materialize``) stay on
the LM's device, copied into a per-trie pool (`MassPool`) whose rows are recycled when the
last state using one is dropped. States read their nodes in place when the pool is in host
memory (a step's next-byte distribution is one indexed read of its row); from a device pool
through `gather`: the nodes every state of the beam is missing are fetched with ONE
``index_select`` on the pool and ONE device-to-host transfer, and values already read are
kept on the host (per pool row, shared by every state on it).

No state ever copies a full ``[N]`` row to the host (``state.mass`` still can, explicitly:
``np.asarray(state.mass)``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

__all__ = ["MassPool", "as_row", "gather"]


class MassPool:
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
                gather([(self, (node,))])
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


def as_row(mass):
    if mass is None or isinstance(mass, (_Row, _HostRow)):
        return mass
    if isinstance(mass, torch.Tensor):
        mass = mass.detach().cpu().numpy()
    array = np.asarray(mass)
    if array.ndim != 1:
        raise ValueError(f"mass must be one value per trie node (1-D), got shape {array.shape}")
    return _HostRow(array)


def gather(requests):
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
