"""pytest-benchmark suite settings: tries built once per session, an opt-in full run,
the regression subset, and what every saved result records about the machine.

    python -m pytest bench -q --benchmark-only                # default: smollm2 + llama3, B <= 32
    python -m pytest bench -q --benchmark-only --bench-full   # + o200k_base, + references at B=128
    python -m pytest bench -q --benchmark-only --bench-regress  # genlm_fast only (bench_regress.sh)
    python -m pytest bench/test_bench_lm.py --benchmark-only --bench-dtype bfloat16
    python -m pytest bench/test_bench_lm.py --benchmark-only --bench-dtype bfloat16 \
        --bench-model llama3.2-1b                             # at the scale users run

Tests marked ``full`` are skipped unless ``--bench-full`` is given. ``--bench-regress``
keeps only `REGRESS_SUBSET`: genlm_fast's own timings, no reference package.

Saved JSON (``--benchmark-save`` / ``--benchmark-autosave``): pytest-benchmark's own
``machine_info`` (CPU, Python) and ``commit_info`` (git id, dirty, branch) plus, from the
hooks below, ``machine_info["genlm_fast"]`` (the device: CPU model, cores, CUDA device,
torch and its threads, built kernel backends, the machine key naming the baseline folder)
and a top-level ``genlm_fast`` block (commit, uncommitted changes, load average before and
after the run). Only stable facts go into ``machine_info``: pytest-benchmark warns when a
compared run's ``machine_info`` differs.
"""

from __future__ import annotations

import gc
import os
import platform
import re
import time
import warnings
from typing import ClassVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from bench import machine
from bench.lm_floor import dtype_names
from bench.tries import (
    Oracle,
    build_fast,
    build_reference,
    check_numbering,
    make_inputs,
    ref_tokens,
)
from bench.vocabs import load_vocab


def pytest_addoption(parser):
    group = parser.getgroup("genlm_fast bench")
    group.addoption(
        "--bench-full",
        action="store_true",
        default=False,
        help="also benchmark o200k_base and the slow references at B=128",
    )
    group.addoption(
        "--bench-regress",
        action="store_true",
        default=False,
        help="only the regression subset: genlm_fast's own benchmarks, "
        "no reference package (see scripts/bench_regress.sh)",
    )
    group.addoption(
        "--bench-dtype",
        default="float32",
        choices=dtype_names(),
        help="the LM benchmarks' model weights, for both implementations (bfloat16: what "
        "dtype='auto' loads for most hub checkpoints)",
    )
    group.addoption(
        "--bench-model",
        default="smollm2",
        choices=("smollm2", "llama3.2-1b", "llama3.1-8b"),
        help="the SMC and beam benchmarks' model (bench/test_bench_lm.py, "
        "bench/test_bench_beam.py): SmolLM2-135M, or a seeded "
        "checkpoint of a Llama-3 architecture (genlm_fast.models.llama3_path; built into the "
        "cache on first use)",
    )


# the LM benchmarks' models (--bench-model), as their summaries name them
MODEL_LABELS = {
    "smollm2": "SmolLM2-135M-Instruct",
    "llama3.2-1b": "Llama-3.2-1B (seeded)",
    "llama3.1-8b": "Llama-3.1-8B (seeded)",
}


@pytest.fixture(scope="session")
def model_name(request):
    """--bench-model: the LM benchmarks' model."""
    return request.config.getoption("--bench-model")


@pytest.fixture(scope="session")
def model_label(model_name):
    return MODEL_LABELS[model_name]


@pytest.fixture(scope="session")
def model_dir(model_name):
    """The model's local directory (a seeded Llama-3 checkpoint is built on first use)."""
    from genlm_fast.models import llama3_path, smollm2_path

    return smollm2_path() if model_name == "smollm2" else llama3_path(model_name)


def pytest_configure(config):
    config.addinivalue_line("markers", "full: part of the long benchmark run (--bench-full)")
    config._genlm_fast_load_before = _load_average()


# The regression subset: genlm_fast's side of each suite, a few minutes on 2 CPU cores.
REGRESS_SUBSET = {
    "test_trie_op": {
        "vocab": ("smollm2", "llama3"),
        "B": (1, 32),
        "impl": ("genlm_fast", "genlm_fast-f64", "genlm_fast-bytes"),
    },
    "test_genlm_fast": {},  # bench/test_bench_lm.py: 16 particles x 8 rounds, SmolLM2
    "test_beam_genlm_fast": {},  # bench/test_bench_beam.py: byte beam K=5, SmolLM2
    "test_program": {},  # bench/test_bench_programs.py: genlm-control's programs, SmolLM2
}


def _in_regress_subset(item):
    rule = REGRESS_SUBSET.get(getattr(item, "originalname", item.name))
    if rule is None:
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    return all(params.get(name) in allowed for name, allowed in rule.items())


def pytest_collection_modifyitems(config, items):
    if config.getoption("--bench-regress"):
        keep = [item for item in items if _in_regress_subset(item)]
        dropped = [item for item in items if not _in_regress_subset(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        return
    if config.getoption("--bench-full"):
        return
    skip = pytest.mark.skip(reason="long benchmark: run with --bench-full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


# --------------------------------------------------------------------------- saved results


def _load_average():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cuda_device():
    """Name of CUDA device 0, or None."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CUDA setup is "no CUDA device" here
        return None


def machine_key():
    """The folder naming this machine's baselines: CPU model, core count, and GPU if any.

    pytest-benchmark's own machine id (``Linux-CPython-3.11-64bit``) is the same on every
    Linux box; timings only compare on the same hardware, so the baselines of each kind of
    machine live in their own ``bench/results/baselines/<machine_key>/``.
    """
    parts = [machine.cpu_model(), f"{os.cpu_count()}c"]
    gpu = cuda_device()
    if gpu:
        parts.append(gpu)
    slug = "-".join(parts).lower()
    slug = re.sub(r"\((r|tm)\)|\bprocessor\b|\bcpu\b", "", slug)
    return re.sub(r"[^a-z0-9.]+", "-", slug).strip("-")


def pytest_benchmark_update_machine_info(config, machine_info):
    import torch

    from genlm_fast.ops import dispatch

    gpu = cuda_device()
    machine_info["genlm_fast"] = {
        "machine_key": machine_key(),
        "device": gpu or f"cpu: {machine.cpu_model()}",
        "cpu": machine.cpu_model(),
        "cores": os.cpu_count(),
        "cuda_device": gpu,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "omp": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")},
        "cpu_backends": dispatch.available_backends("cpu"),
        "python": platform.python_version(),
    }


def pytest_benchmark_update_json(config, benchmarks, output_json):
    commit = machine.git("rev-parse", "HEAD") or None
    dirty = machine.git("status", "--porcelain", "--untracked-files=no")
    output_json["genlm_fast"] = {
        "commit": commit,
        "uncommitted_changes": bool(dirty),
        "device": output_json.get("machine_info", {}).get("genlm_fast", {}).get("device"),
        "load_average_before": getattr(config, "_genlm_fast_load_before", None),
        "load_average_after": _load_average(),
        "regress_subset": bool(config.getoption("--bench-regress")),
    }


class TrieBank:
    """Vocabularies, tries and oracles, built lazily and kept for the session.

    Only one vocabulary's tries are kept at a time (the tests are ordered by vocabulary):
    the references hold hundreds of MB each on a 200k vocabulary.
    """

    FAST: ClassVar[dict] = {
        "genlm_fast": "parallel",
        "genlm_fast-f64": "char",
        "genlm_fast-bytes": "byte",
    }
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
        self.label, self.vocab = load_vocab(name)
        self.ref_vocab = ref_tokens(self.vocab)
        self._name = name
        self.build_seconds = {}

    def trie(self, name, impl):
        self._switch(name)
        if impl not in self._tries:
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                if impl in self.FAST:
                    trie = build_fast(self.vocab, self.FAST[impl])
                else:
                    trie = build_reference(self.ref_vocab, self.REFS[impl])
            self.build_seconds[impl] = time.perf_counter() - start
            if impl in ("genlm_fast", "genlm_fast-f64"):
                check_numbering(trie, self.trie(name, "ref-numba"))
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
            self._inputs = make_inputs(len(self.vocab), B)
            self._inputs_key = B
            self._expected = {}
        return self._inputs

    def expected(self, name, B, op):
        """Float64 oracle values ``[B, N]`` of ``op`` on ``inputs(name, B)``."""
        logits, probs = self.inputs(name, B)
        if op not in self._expected:
            if self.oracle is None:
                self.oracle = Oracle(self.trie(name, "ref-numba"))
            self._expected[op] = self.oracle.expected(op, logits, probs)
        return self._expected[op]


@pytest.fixture(scope="session")
def bank():
    return TrieBank()
