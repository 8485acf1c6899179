"""Key/value buffers a transformers forward reads its past from and writes its new
positions into: one ``[L, 2, B, H, T, D]`` tensor per forward, the rows' stored pasts copied
in once (`copy_pasts`), each layer's new keys and values written in place after them
(`buffer_cache`)."""

from __future__ import annotations

import functools


def copy_pasts(kv, plans, fill_to):
    """Copy each row's stored past into ``kv`` ``[L, 2, B, H, T, D]``: row ``i`` of
    ``plans`` (``(ids, depth, runs)``, ``runs`` the `KVTrie` segments ``(segment, a, b)`` of
    its first ``depth`` positions) to positions ``[0, depth)``, and zeros in
    ``[depth, fill_to)``: masked, but they must be finite (0 * NaN would poison the
    attention). Rows that read the same run to the same positions (the shared prompt of
    many particles) get it in one broadcast copy per block of consecutive rows."""
    readers = {}
    for i, (_, d, runs) in enumerate(plans):
        at = 0
        for s, a, b in runs:
            readers.setdefault((id(s), a, b, at), (s, []))[1].append(i)
            at += b - a
        if d < fill_to:
            kv[:, :, i, :, d:fill_to] = 0
    for (_, a, b, at), (s, rows) in readers.items():
        for first, last in consecutive_blocks(rows):
            kv[:, :, first : last + 1, :, at : at + b - a] = s.data[:, :, None, :, a:b]


def consecutive_blocks(rows):
    """Increasing row numbers as (first, last) of each block of consecutive ones."""
    first = prev = rows[0]
    for r in rows[1:]:
        if r != prev + 1:
            yield first, prev
            first = r
        prev = r
    yield first, prev


@functools.cache
def buffer_layer_class():
    """transformers' ``DynamicLayer`` over preallocated key and value buffers
    ``[B, H, T, D]`` whose first positions already hold the past: ``update`` writes the
    new states in place after them (the stock layer concatenates, copying the whole past
    each forward). States that do not fit (another shape, dtype or length) are
    concatenated as the stock layer does, and ``in_place`` turns False. Defined on first
    use: transformers is imported only with this backend."""
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
        def __init__(self, key_buffer, value_buffer, filled):
            super().__init__()
            self.dtype, self.device = key_buffer.dtype, key_buffer.device
            self._key_buffer, self._value_buffer = key_buffer, value_buffer
            self.keys = key_buffer[:, :, :filled]
            self.values = value_buffer[:, :, :filled]
            self.is_initialized = True
            self.in_place = True

        def update(self, key_states, value_states, *args, **kwargs):
            start = self.keys.shape[2]
            stop = start + key_states.shape[2]
            target = self._key_buffer[:, :, start:stop]
            if (
                self.in_place
                and stop <= self._key_buffer.shape[2]
                and key_states.shape == target.shape
                and value_states.shape == target.shape
                and key_states.dtype == value_states.dtype == self.dtype
            ):
                target.copy_(key_states)
                self._value_buffer[:, :, start:stop].copy_(value_states)
                self.keys = self._key_buffer[:, :, :stop]
                self.values = self._value_buffer[:, :, :stop]
                return self.keys, self.values
            self.in_place = False
            return super().update(key_states, value_states, *args, **kwargs)

    return _BufferLayer


def buffer_cache(kv, filled):
    """A ``DynamicCache`` whose layer ``l`` writes into ``kv[l]`` ([L, 2, B, H, T, D]),
    positions ``[0, filled)`` being the past."""
    from transformers import DynamicCache

    layer = buffer_layer_class()
    cache = DynamicCache()
    cache.layers = [layer(kv[i, 0], kv[i, 1], filled) for i in range(kv.shape[0])]
    return cache
