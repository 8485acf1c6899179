"""The compiled kernels' sources: where they live, what the CPU build compiles and with
which flags, and their digest.

Imports nothing from genlm_fast: ``setup.py`` loads this file by path, so that the install
and the JIT build (`extension`) compile the same files with the same flags, and so that it
can stamp the ``genlm_fast._C`` it builds with the digest of the sources it compiled (a
prebuilt module older than an edited ``csrc/`` is then noticed: `extension.stale_reason`).
"""

from __future__ import annotations

import hashlib
import os

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "csrc")
CPU_SOURCES = ("bindings.cpp", "linear_cpu.cpp", "trie_reduce_cpu.cpp")
CUDA_SOURCES = ("trie_reduce_cuda.cu",)  # added, with -DWITH_CUDA, by a CUDA build only
CXX_FLAGS = ("-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno")  # no -march: any x86-64
_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")


def digest(csrc: str = CSRC) -> str | None:
    """SHA-256 over the names and contents of csrc's source files; None where there is no
    ``csrc/`` (an installed wheel has none)."""
    try:
        names = source_files(csrc)
    except OSError:
        return None
    sha = hashlib.sha256()
    for name in names:
        with open(os.path.join(csrc, name), "rb") as f:
            sha.update(name.encode() + b"\0" + f.read() + b"\0")
    return sha.hexdigest()


def source_files(csrc: str = CSRC) -> list[str]:
    """Names of every source and header in ``csrc`` (sorted)."""
    return sorted(n for n in os.listdir(csrc) if n.endswith(_SUFFIXES))
