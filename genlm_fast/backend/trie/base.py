"""genlm.backend's ``TokenCharacterTrie`` and ``ParallelTokenCharacterTrie`` on the fused kernels."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from genlm_fast.trie_core import CompiledTrie, item_entry, one_row


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

    def __init__(self, decode, kernel_backend="auto", cache=True, cache_dir=None):
        if decode is None or len(decode) == 0:
            raise ValueError("cannot build a trie over an empty vocabulary")
        self.decode = decode
        self.kernel_backend = kernel_backend
        words, keys = [], []
        plain_bytes_seen = False
        all_bytes = True
        self.word2leaf = {}
        for idx, item in enumerate(decode):
            word, key, plain = item_entry(item)
            if plain and not plain_bytes_seen:
                plain_bytes_seen = True
                warnings.warn("Passing plain bytes to TokenCharacterTrie is deprecated; use "
                              "Token objects from decode_vocab() instead.",
                              DeprecationWarning, stacklevel=2)
            all_bytes &= isinstance(item, bytes)
            if key in self.word2leaf:
                raise ValueError(f"Duplicate word in vocabulary: {key!r}")
            self.word2leaf[key] = idx  # replaced by the leaf id below
            words.append(word)
            keys.append(key)
        cache_key = None
        if all_bytes:
            cache_key = ("char", [bytes(w) for w in words],
                         [k[1] if isinstance(k, tuple) else -1 for k in keys])
        self._compile(words, [(None, i) for i in range(len(words))], np.arange(len(words)),
                      cache_key=cache_key, cache=cache, cache_dir=cache_dir)
        leaf_node = self._layout.leaf_node
        self.word2leaf = {key: int(leaf_node[i]) for i, key in enumerate(keys)}
        self.idx_to_leaf = np.stack(
            [np.arange(len(words), dtype=np.int32), leaf_node.astype(np.int32)], axis=1)

    def _preprocess_ws(self, ws):
        """genlm's sequential-trie preprocessing: a tensor becomes a host numpy array."""
        if isinstance(ws, torch.Tensor):
            return ws.detach().cpu().numpy()
        return ws

    def _host(self, result: torch.Tensor) -> np.ndarray:
        return result.cpu().numpy()

    def weight_sum(self, ws):
        """Sum of the weights of the tokens beneath every node: ``[V]`` -> ``[N]``."""
        return self._host(self._reduce(one_row(ws), "sum", device=self.device,
                                       dtype=self._out_dtype)[0])

    def weight_max(self, ws):
        """Max of the weights of the tokens beneath every node: ``[V]`` -> ``[N]``."""
        return self._host(self._reduce(one_row(ws), "max", device=self.device,
                                       dtype=self._out_dtype)[0])

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
    _preprocess_ws = CompiledTrie._preprocess_ws  # float32 rows on the device, as in genlm

    def __init__(self, decode, device=None, **kwargs):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if str(device) not in ("cpu", "cuda"):
            raise ValueError(f"Invalid device: {device!r}. Must be 'cpu', 'cuda' or None")
        self.device = str(device)
        super().__init__(decode, **kwargs)
        self.positions = torch.as_tensor(self.idx_to_leaf[:, 0], dtype=torch.long,
                                         device=self.device)
