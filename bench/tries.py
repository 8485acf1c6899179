"""The tries the CPU benchmarks and the GPU table compare, the inputs they are fed, and the
float64 oracle every genlm_fast result is checked against.

* ``make_inputs``: random float32 logits (~ N(0, 3^2)) and their softmax, ``[B, V]``.
* ``build_fast`` / ``build_reference``: genlm_fast's tries and genlm-backend's (numba,
  sparse) or genlm-bytes', on the same vocabulary (``ref_tokens``: as genlm's ``Token``).
* ``op_fn`` / ``op_input``: an operation (``sum``, ``max``, ``log_mass``) of a trie as a
  one-argument call, and its input; the references have no log-mass op, so theirs is
  ``log(batch_weight_sum(exp(log_softmax(logits))))``.
* ``Oracle`` (genlm's numba trie fed float64 weights) and ``check_result``: relative error
  <= 1e-5 on every node whose mass >= 1e-30; ``check_numbering``: genlm_fast numbers the
  nodes as genlm does, so that node-wise comparisons mean something.

Used by `bench.kernels`, the pytest-benchmark suite (``bench/conftest.py``,
``bench/test_bench_tries.py``), the contention benchmark and ``tools/gpu``.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

OPS = ("sum", "max", "log_mass")
OP_METHOD = {"sum": "batch_weight_sum", "max": "batch_weight_max", "log_mass": "batch_log_mass"}
REL_TOL = 1e-5  # the bound every backend meets: relative error of linear masses
MIN_MASS = 1e-30
LOGIT_SCALE = 3.0  # logits ~ N(0, 3^2): probabilities spread over ~30 nats, like an LM's


# --------------------------------------------------------------------------- vocabularies


def ref_tokens(vocab):
    """The same vocabulary as genlm.backend's own ``Token`` objects."""
    from genlm.backend.tokenization import Token as RefToken

    return [RefToken(t.token_id, t.byte_string) for t in vocab]


def make_inputs(vocab_size: int, batch: int, seed: int = 0):
    """``(logits, probs)``: float32 ``[B, V]`` random logits and their softmax."""
    g = torch.Generator().manual_seed(seed * 1000 + batch)
    logits = torch.randn(batch, vocab_size, generator=g) * LOGIT_SCALE
    return logits, torch.softmax(logits, dim=-1)


# --------------------------------------------------------------------------- implementations


def ref_log_mass(trie, logits):
    """The references' log-mass: log_softmax, exp, their batch_weight_sum, log."""
    out = trie.batch_weight_sum(torch.log_softmax(logits, dim=-1).exp())
    if isinstance(out, torch.Tensor):
        return torch.log(out)
    with np.errstate(divide="ignore"):
        return np.log(out)


def op_fn(trie, op: str, reference: bool):
    """A one-argument callable running ``op`` on ``trie`` (its input: probs; log_mass: logits)."""
    if op == "log_mass" and reference:
        return functools.partial(ref_log_mass, trie)
    return getattr(trie, OP_METHOD[op])


def op_input(op: str, logits, probs):
    return logits if op == "log_mass" else probs


def as_numpy64(result) -> np.ndarray:
    if isinstance(result, torch.Tensor):
        result = result.detach().cpu().numpy()
    return np.asarray(result, dtype=np.float64)


class Oracle:
    """Float64 node values from genlm's numba ``TokenCharacterTrie`` (fed float64 weights)."""

    def __init__(self, numba_trie):
        self.trie = numba_trie
        self.num_nodes = len(numba_trie.children)
        self._cache = {}

    def expected(self, op: str, logits, probs, key=None) -> np.ndarray:
        if key is not None and (key, op) in self._cache:
            return self._cache[key, op]
        if op == "sum":
            want = self.trie.batch_weight_sum(probs.double())
        elif op == "max":  # probabilities are > 0, so numba's 0-initialised max is exact
            want = self.trie.batch_weight_max(probs.double())
        else:
            p = torch.softmax(logits.double(), dim=-1)
            with np.errstate(divide="ignore"):
                want = np.log(self.trie.batch_weight_sum(p))
        want = np.asarray(want, dtype=np.float64)
        if key is not None:
            self._cache[key, op] = want
        return want


def check_result(
    got, want: np.ndarray, op: str, *, byte_trie: bool = False, label: str = "", strict: bool = True
) -> float:
    """Assert ``got`` matches the oracle; return the worst relative error of a node's mass
    (``strict=False``: only measure it, e.g. for the references).

    Nodes with true mass >= 1e-30 must be within relative 1e-5. For ``log_mass`` the
    relative error of the mass is ``|expm1(got - want)|``; a float32 log-mass of magnitude
    m cannot be closer than half an ulp (m * 2^-24), so that much is allowed on top.
    A genlm_fast ``TokenByteTrie`` has one more node than the character trie (the EOS node,
    numbered just before the root); it must be empty (0 / -inf) in WITHOUT_EOS mode.
    """
    got = as_numpy64(got)
    if byte_trie:
        n = want.shape[1]
        assert got.shape == (want.shape[0], n + 1), (label, got.shape, want.shape)
        eos = got[:, n - 1]
        assert not strict or np.all(eos == (-np.inf if op == "log_mass" else 0.0)), (
            f"{label}: EOS node not empty"
        )
        got = np.concatenate([got[:, : n - 1], got[:, n:]], axis=1)
    assert got.shape == want.shape, (label, got.shape, want.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        if op == "log_mass":
            keep = want >= np.log(MIN_MASS)
            rel = np.abs(np.expm1(got[keep] - want[keep]))
            rel = np.where(np.isnan(rel), np.inf, rel)
            tol = REL_TOL + np.abs(want[keep]) * 2.0**-23
            ok = bool(np.all(rel <= tol))
            empty_ok = bool(np.all(np.isneginf(got[np.isneginf(want)])))
        else:
            keep = np.abs(want) >= MIN_MASS
            rel = np.abs(got[keep] - want[keep]) / np.abs(want[keep])
            rel = np.where(np.isnan(rel), np.inf, rel)
            ok = bool(np.all(rel <= REL_TOL))
            empty_ok = bool(np.all(got[want == 0] == 0))
    worst = float(rel.max()) if rel.size else 0.0
    if strict:
        assert not np.isnan(got).any(), f"{label}: NaN in result"
        assert ok, f"{label}: relative error of a node's mass {worst:.3g} > {REL_TOL:g}"
        assert empty_ok, f"{label}: mass where there is none"
    return worst


# --------------------------------------------------------------------------- trie builders


def build_fast(vocab, kind: str = "parallel", **kwargs):
    """genlm_fast trie of ``kind`` ("parallel" f32, "char" f64, "byte"), auto backend."""
    from genlm_fast.backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
    from genlm_fast.bytes import TokenByteTrie

    kwargs.setdefault("kernel_backend", "auto")
    if kind == "parallel":
        return ParallelTokenCharacterTrie(vocab, device="cpu", **kwargs)
    if kind == "char":
        return TokenCharacterTrie(vocab, **kwargs)
    if kind == "byte":
        return TokenByteTrie(vocab, device="cpu", **kwargs)
    raise ValueError(kind)


def build_reference(ref_vocab, kind: str):
    """genlm reference trie: "numba" (TokenCharacterTrie), "sparse" (ParallelTokenCharacterTrie
    on cpu) or "bytes" (genlm.bytes TokenByteTrie on cpu)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "numba":
            from genlm.backend.trie import TokenCharacterTrie

            return TokenCharacterTrie(ref_vocab)
        if kind == "sparse":
            from genlm.backend.trie import ParallelTokenCharacterTrie

            return ParallelTokenCharacterTrie(ref_vocab, device="cpu")
        if kind == "bytes":
            from genlm.bytes import TokenByteTrie

            return TokenByteTrie(ref_vocab, device="cpu")
    raise ValueError(kind)


def check_numbering(fast, numba_trie):
    """genlm_fast must number nodes as genlm does, or node-wise comparisons mean nothing."""
    assert fast.num_nodes == len(numba_trie.children), (fast.num_nodes, len(numba_trie.children))
    assert np.array_equal(np.asarray(fast.idx_to_leaf), np.asarray(numba_trie.idx_to_leaf))
