"""genlm.backend's ``TokenCharacterTrie`` and ``ParallelTokenCharacterTrie`` on our kernels."""

from __future__ import annotations

import threading
import warnings
import weakref

import numpy as np
import torch

from genlm_fast.trie_core import CompiledTrie, as_vocabulary, item_entry, one_row, trie_device

# GPU results reach the host through page-locked ("pinned") memory: torch's caching host
# allocator hands the same block back call after call, so the copy runs at the link's speed
# into pages already mapped. A pageable copy (``result.cpu()``) lands in a fresh [B, N]
# block each call, every page of it faulted in, far below the link's speed (for genlm's trie
# and ours alike). The array returned is a view of
# the pinned block, which goes back to the cache once the array is freed. Pinned memory is
# RAM the OS cannot page out: past PINNED_LIMIT bytes of such arrays alive at once (an app
# that keeps every result), a call takes the pageable copy instead.
PINNED_LIMIT = 1 << 30


class _PinnedArrays:
    """The bytes of pinned result arrays alive now (freed ones leave through weakref)."""

    def __init__(self):
        self.alive = 0
        # reentrant: a freed array's finalizer may run in whatever thread drops it, even
        # one inside reserve()
        self.lock = threading.RLock()

    def reserve(self, nbytes: int) -> bool:
        with self.lock:
            if self.alive + nbytes > PINNED_LIMIT:
                return False
            self.alive += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.alive -= nbytes


_pinned_arrays = _PinnedArrays()


def _pinned_empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)


def to_host(result: torch.Tensor) -> np.ndarray:
    """``result`` as a numpy array on the host: as it is on the CPU; from a GPU through a
    pinned block while fewer than PINNED_LIMIT bytes of those are alive (see above)."""
    if result.device.type == "cpu":
        return result.numpy()
    if result.device.type == "cuda":
        return _via_pinned(result)
    return result.cpu().numpy()


def _via_pinned(result: torch.Tensor) -> np.ndarray:
    nbytes = result.numel() * result.element_size()
    if not _pinned_arrays.reserve(nbytes):
        return result.cpu().numpy()
    try:
        host = _pinned_empty(result)
    except RuntimeError:  # no page-locked memory to be had: the pageable copy
        _pinned_arrays.release(nbytes)
        return result.cpu().numpy()
    try:
        host.copy_(result)  # to pinned memory: an async copy, then a wait for its stream
        array = host.numpy()  # holds the pinned block until it (and every view) is freed
    except BaseException:
        _pinned_arrays.release(nbytes)
        raise
    weakref.finalize(array, _pinned_arrays.release, nbytes)
    return array


class TokenCharacterTrie(CompiledTrie):
    """A trie over a token vocabulary; node values are reductions over token weights.

    Args:
        decode: the vocabulary: ``Token`` objects (from ``decode_vocab``; genlm's ``Token``
            too), plain ``bytes`` (deprecated) or any iterables of edge keys (e.g. strings,
            genlm-control's EOS).
            Weight ``ws[i]`` belongs to ``decode[i]``.
        kernel_backend: "auto" (default), "reference", "cpu", "cuda" or "triton".
        cache: keep the compiled layout in an on-disk cache keyed by the vocabulary.

    Results are numpy float64 arrays on the host (as in genlm); ``log_mass`` /
    ``batch_log_mass`` return float32 tensors on the logits' device.
    """

    device = "cpu"
    _out_dtype = torch.float64
    _reads_first_columns = True  # as genlm's sequential trie: a longer row's tail is ignored

    def __init__(self, decode, kernel_backend="auto", cache=True, cache_dir=None):
        decode = as_vocabulary(decode)
        if decode is None or len(decode) == 0:
            raise ValueError("cannot build a trie over an empty vocabulary")
        self.decode = decode
        self.kernel_backend = kernel_backend
        words, keys = [], []
        plain_bytes_seen = False
        all_bytes = True
        seen = set()
        for item in decode:
            word, key, plain = item_entry(item)
            if plain and not plain_bytes_seen:
                plain_bytes_seen = True
                warnings.warn(
                    "Passing plain bytes to TokenCharacterTrie is deprecated; use "
                    "Token objects from decode_vocab() instead.",
                    DeprecationWarning,
                    stacklevel=2,
                )
            all_bytes &= isinstance(item, bytes)
            if key in seen:
                raise ValueError(f"Duplicate word in vocabulary: {key!r}")
            seen.add(key)
            words.append(word)
            keys.append(key)
        cache_key = None
        if all_bytes:
            cache_key = (
                "char",
                [bytes(w) for w in words],
                [k[1] if isinstance(k, tuple) else -1 for k in keys],
            )
        self._compile(
            words,
            [(None, i) for i in range(len(words))],
            np.arange(len(words)),
            cache_key=cache_key,
            cache=cache,
            cache_dir=cache_dir,
        )
        leaf_node = self._layout.leaf_node
        self.word2leaf = {key: int(leaf_node[i]) for i, key in enumerate(keys)}
        self.idx_to_leaf = np.stack(
            [np.arange(len(words), dtype=np.int32), leaf_node.astype(np.int32)], axis=1
        )

    def _preprocess_ws(self, ws):
        """genlm's sequential-trie preprocessing (its own test suites call it): a tensor
        becomes a host numpy array."""
        if isinstance(ws, torch.Tensor):
            return ws.detach().cpu().numpy()
        return ws

    def _host(self, result: torch.Tensor) -> np.ndarray:
        return to_host(result)

    def weight_sum(self, ws):
        """Sum of the weights of the tokens beneath every node: ``[V]`` -> ``[N]``."""
        return self._host(
            self._reduce(one_row(ws), "sum", device=self.device, dtype=self._out_dtype)[0]
        )

    def weight_max(self, ws):
        """Max of the weights of the tokens beneath every node: ``[V]`` -> ``[N]``."""
        return self._host(
            self._reduce(one_row(ws), "max", device=self.device, dtype=self._out_dtype)[0]
        )

    def batch_weight_sum(self, ws):
        """``weight_sum`` of every row of ``ws`` (a list of ``[V]`` or a ``[B, V]``)."""
        return self._host(self._reduce(ws, "sum", device=self.device, dtype=self._out_dtype))

    def batch_weight_max(self, ws):
        """``weight_max`` of every row of ``ws`` (a list of ``[V]`` or a ``[B, V]``)."""
        return self._host(self._reduce(ws, "max", device=self.device, dtype=self._out_dtype))

    # the older genlm names
    def mass_sum(self, p_llm):
        return self.weight_sum(p_llm)

    def batch_mass_sum(self, p_llms):
        return self.batch_weight_sum(p_llms)


class ParallelTokenCharacterTrie(TokenCharacterTrie):
    """``TokenCharacterTrie`` whose work runs on ``device`` ("cpu", "cuda" or None: cuda
    when available). Results are numpy float32 arrays, as in genlm."""

    _out_dtype = torch.float32
    _reads_first_columns = False  # as genlm's: exactly one weight per token
    _preprocess_ws = CompiledTrie._preprocess_ws  # float32 rows on the device, as in genlm

    def __init__(self, decode, device=None, **kwargs):
        self.device = trie_device(device)
        super().__init__(decode, **kwargs)
        self.positions = torch.as_tensor(
            self.idx_to_leaf[:, 0], dtype=torch.long, device=self.device
        )
