"""Test-wide settings: Triton kernels run under the CPU interpreter where there is no GPU
(compiled on a GPU), and nothing touches a model hub."""

import os

import pytest
import torch  # (does not import triton)

# Both must be set before anything imports triton or huggingface_hub.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The files that take longest, in the order they should start: scripts/test.sh spreads whole
# files over pytest-xdist workers in collection order, and a long file started last would run
# alone at the end. The other files keep pytest's order after these.
LONGEST_FIRST = (
    "tests/compat/test_genlm_control_programs.py",
    "tests/ops/test_extension_build.py",
    "tests/ops/test_cuda_emulation.py",
    "tests/ops/test_cuda_compile.py",
    "tests/test_llama3_checkpoint.py",
    "tests/test_models.py",
    "tests/backend/test_llm_memory.py",
    "tests/backend/test_llm_concurrency.py",
    "tests/ops/test_trie_reduce.py",
    "tests/bytes/test_beam_smollm2.py",
    "tests/ops/test_triton_kernels.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests, restored afterwards: small, latency-bound ops,
    whose OpenMP hand-offs cost more than the ops when other processes share the CPUs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
