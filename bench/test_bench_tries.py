"""Side-by-side benchmarks: genlm_fast vs genlm-backend / genlm-bytes, on the same inputs.

One ``benchmark.group`` per (vocabulary, op, B), e.g. ``llama3-sum-B32``, holding:

* ``genlm_fast`` (``ParallelTokenCharacterTrie(device="cpu")``, float32),
  ``genlm_fast-f64`` (``TokenCharacterTrie``, float64), ``genlm_fast-bytes`` (``TokenByteTrie``),
  all with ``kernel_backend="auto"``; each result is asserted against a float64 oracle
  (genlm's numba trie fed float64 weights): relative error <= 1e-5 on every node with
  mass >= 1e-30;
* ``ref-numba`` (genlm.backend ``TokenCharacterTrie``), ``ref-sparse`` (genlm.backend
  ``ParallelTokenCharacterTrie`` on cpu), ``ref-bytes`` (genlm.bytes ``TokenByteTrie`` on cpu),
  timed with ``benchmark.pedantic`` and few rounds (they take up to ~1 s a call). Their error
  against the oracle is recorded in ``extra_info`` (not asserted).

Ops: ``sum`` = batch_weight_sum(probs), ``max`` = batch_weight_max(probs), ``log_mass`` =
batch_log_mass(logits); the references' log_mass is log(batch_weight_sum(exp(log_softmax))).

Default run: smollm2 (gpt2 if it cannot be loaded) and llama3 at B in {1, 8, 32}, plus
genlm_fast alone at B=128. ``--bench-full`` adds o200k_base and the references at B=128.
"""

from __future__ import annotations

import time
import warnings

import pytest

from bench.tries import OPS, check_result, op_fn, op_input

VOCABS = ("smollm2", "llama3", "o200k_base")
BATCHES = (1, 8, 32, 128)
IMPLS = ("genlm_fast", "genlm_fast-f64", "genlm_fast-bytes", "ref-numba", "ref-sparse", "ref-bytes")
FULL_VOCABS = {"o200k_base"}
TARGET_REF_SECONDS = 2.0  # total time to spend on one reference benchmark


def _cases():
    for vocab in VOCABS:  # vocabulary outermost: the bank keeps one vocabulary's tries at a time
        for B in BATCHES:
            for op in OPS:
                for impl in IMPLS:
                    full = vocab in FULL_VOCABS or (B == 128 and impl.startswith("ref-"))
                    yield pytest.param(
                        vocab,
                        B,
                        op,
                        impl,
                        marks=[pytest.mark.full] if full else [],
                        id=f"{vocab}-{op}-B{B}-{impl}",
                    )


@pytest.mark.parametrize(("vocab", "B", "op", "impl"), list(_cases()))
def test_trie_op(benchmark, bank, vocab, B, op, impl):
    trie = bank.trie(vocab, impl)
    logits, probs = bank.inputs(vocab, B)
    x = op_input(op, logits, probs)
    reference = impl.startswith("ref-")
    fn = op_fn(trie, op, reference)
    benchmark.group = f"{bank.label}-{op}-B{B}"
    benchmark.extra_info.update(
        vocab=bank.label,
        V=len(bank.vocab),
        op=op,
        B=B,
        impl=impl,
        nodes=trie.num_nodes if not reference else len(trie.children),
        build_s=round(bank.build_seconds.get(impl, 0.0), 3),
    )
    byte_trie = impl in ("genlm_fast-bytes", "ref-bytes")
    if reference:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            fn(x)  # warm-up (numba compiles on its first call); sizes the rounds
            once = time.perf_counter() - start
            rounds = int(min(20, max(3, TARGET_REF_SECONDS / max(once, 1e-6))))
            result = benchmark.pedantic(fn, args=(x,), rounds=rounds, iterations=1, warmup_rounds=0)
        want = bank.expected(vocab, B, op)
        benchmark.extra_info["max_rel_err"] = check_result(
            result, want, op, byte_trie=byte_trie, strict=False
        )
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "auto" falling back: recorded below
        result = benchmark(fn, x)
    benchmark.extra_info["backend"] = trie.last_kernel_backend
    want = bank.expected(vocab, B, op)
    benchmark.extra_info["max_rel_err"] = check_result(
        result, want, op, byte_trie=byte_trie, label=f"{impl} {bank.label} {op} B={B}"
    )
