"""The benchmark-only probes of bench/csrc/probes.cpp (the machine's read bandwidth and FMA
rate), built on first use with ``torch.utils.cpp_extension.load``: the product extension
``genlm_fast._C`` holds only what the product calls."""

from __future__ import annotations

import functools
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "csrc" / "probes.cpp"
PRODUCT_CSRC = Path(__file__).resolve().parents[1] / "csrc"  # cpu_features.h


@functools.cache
def load():
    """The compiled probes module (built into torch's extension cache the first time)."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name="genlm_fast_bench_probes",
        sources=[str(SOURCE)],
        extra_include_paths=[str(PRODUCT_CSRC)],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
