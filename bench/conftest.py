"""pytest-benchmark suite settings: tries built once per session, an opt-in full run.

    python -m pytest bench -q --benchmark-only                # default: smollm2 + llama3, B <= 32
    python -m pytest bench -q --benchmark-only --bench-full   # + o200k_base, + references at B=128

Tests marked ``full`` are skipped unless ``--bench-full`` is given.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from typing import ClassVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from bench import kernels as K


def pytest_addoption(parser):
    group = parser.getgroup("genlm_fast bench")
    group.addoption("--bench-full", action="store_true", default=False,
                    help="also benchmark o200k_base and the slow references at B=128")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: part of the long benchmark run (--bench-full)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--bench-full"):
        return
    skip = pytest.mark.skip(reason="long benchmark: run with --bench-full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


class TrieBank:
    """Vocabularies, tries and oracles, built lazily and kept for the session.

    Only one vocabulary's tries are kept at a time (the tests are ordered by vocabulary):
    the references hold hundreds of MB each on a 200k vocabulary.
    """

    FAST: ClassVar[dict] = {"genlm_fast": "parallel", "genlm_fast-f64": "char", "genlm_fast-bytes": "byte"}
    REFS: ClassVar[dict] = {"ref-numba": "numba", "ref-sparse": "sparse", "ref-bytes": "bytes"}

    def __init__(self):
        self._name = None
        self._tries = {}
        self.label = None
        self.vocab = None
        self.ref_vocab = None
        self.oracle = None
        self._inputs_key = None
        self._inputs = None
        self._expected = {}
        self.build_seconds = {}

    def _switch(self, name):
        if name == self._name:
            return
        self._tries.clear()
        self.oracle = None
        self._inputs_key = None
        self._inputs = None
        self._expected = {}
        gc.collect()
        self.label, self.vocab = K.load_vocab(name)
        self.ref_vocab = K.ref_tokens(self.vocab)
        self._name = name
        self.build_seconds = {}

    def trie(self, name, impl):
        self._switch(name)
        if impl not in self._tries:
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                if impl in self.FAST:
                    trie = K.build_fast(self.vocab, self.FAST[impl])
                else:
                    trie = K.build_reference(self.ref_vocab, self.REFS[impl])
            self.build_seconds[impl] = time.perf_counter() - start
            if impl in ("genlm_fast", "genlm_fast-f64"):
                K.check_numbering(trie, self.trie(name, "ref-numba"))
            elif impl in ("genlm_fast-bytes", "ref-bytes"):
                # the byte trie = the character trie + an EOS node numbered just before the root
                n = len(self.trie(name, "ref-numba").children)
                assert (trie.eos_node, trie.root) == (n - 1, n), (trie.eos_node, trie.root, n)
            self._tries[impl] = trie
        return self._tries[impl]

    def inputs(self, name, B):
        """``(logits, probs)`` for batch size B (the same tensors for every implementation)."""
        self._switch(name)
        if self._inputs_key != B:
            self._inputs = K.make_inputs(len(self.vocab), B)
            self._inputs_key = B
            self._expected = {}
        return self._inputs

    def expected(self, name, B, op):
        """Float64 oracle values ``[B, N]`` of ``op`` on ``inputs(name, B)``."""
        logits, probs = self.inputs(name, B)
        if op not in self._expected:
            if self.oracle is None:
                self.oracle = K.Oracle(self.trie(name, "ref-numba"))
            self._expected[op] = self.oracle.expected(op, logits, probs)
        return self._expected[op]


@pytest.fixture(scope="session")
def bank():
    return TrieBank()
