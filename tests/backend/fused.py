"""When the tests of the fused CPU decoder may skip: only on a CPU without AVX-512F, as the
CPU itself says (/proc/cpuinfo), not as the compiled extension says. On a CPU with it, a
missing, stale or broken ``genlm_fast._C`` fails those tests instead of skipping them."""

import pytest


def cpu_has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "avx512f" in line.split() for line in f)
    except OSError:  # not Linux: the decoder is built for Linux x86-64 only
        return False


needs_fused = pytest.mark.skipif(
    not cpu_has_avx512f(), reason="this CPU lacks AVX-512F, the fused decoder's instructions"
)
