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
import shutil
import subprocess
import tempfile

CSRC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc"
)
CPU_SOURCES = (
    "bindings.cpp",
    "cpu_threads.cpp",
    "decoder_cpu.cpp",
    "linear_cpu.cpp",
    "linear_rows_cpu.cpp",
    "trie_reduce_cpu.cpp",
    "trie_reduce_cpu_op.cpp",
    "weight_watch.cpp",
)
# -DGF_TRIE_ONLY: a module of the trie op alone (bindings.cpp leaves the others out), what the
# tests' build of the trie kernels' baseline versions (-DGF_BASELINE_ONLY) compiles
TRIE_CPU_SOURCES = (
    "bindings.cpp",
    "cpu_threads.cpp",
    "trie_reduce_cpu.cpp",
    "trie_reduce_cpu_op.cpp",
)
# added, with -DWITH_CUDA, by a CUDA build only
CUDA_SOURCES = ("trie_reduce_cuda.cu", "trie_reduce_cuda_op.cpp")
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


# --------------------------------------------------------------------------- the C++ compiler

_PROBE = """#include <sstream>
#include <string>
std::string probe(long v) { std::ostringstream s; s << v; return s.str(); }
"""


def configured_compiler() -> str | None:
    """The C++ compiler torch's build would run (``$CXX``, else ``c++``), resolved on PATH."""
    return shutil.which(os.environ.get("CXX") or "c++")


def needs_shared_libstdcxx(library: str) -> bool | None:
    """Whether the shared object ``library`` lists the shared libstdc++ in its dynamic
    section (readelf); None where that cannot be read."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    try:
        dynamic = subprocess.run(
            [readelf, "-d", library], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return "libstdc++.so" in dynamic.stdout if dynamic.returncode == 0 else None


def links_shared_libstdcxx(compiler: str) -> bool | None:
    """Whether ``compiler`` links a C++ shared object against the shared libstdc++, as torch
    is linked: it builds a two-line one and reads its dynamic section. None where that
    cannot be told (no readelf, the probe does not build).

    A compiler that copies a static libstdc++ into the extension instead (some /opt/gcc
    installs do) gives it a second C++ runtime with its own locale, beside torch's:
    the extension's error messages (TORCH_CHECK) then crash the process when they format a
    number."""
    if shutil.which("readelf") is None:
        return None
    with tempfile.TemporaryDirectory(prefix="genlm_fast_cxx_") as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE)
        try:
            built = subprocess.run(
                [compiler, "-shared", "-fPIC", "-o", lib, src],
                capture_output=True,
                timeout=120,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return needs_shared_libstdcxx(lib) if built.returncode == 0 else None


def choose_compilers(cxx: str) -> tuple[str, str | None, str | None]:
    """The C++ compiler to build the extension with, its C companion (for the link step
    setuptools runs; None: leave CC alone) and a warning (None: nothing to say). ``cxx``,
    unless it links libstdc++ statically (``links_shared_libstdcxx``) and a g++/c++ in
    /usr/bin links the shared one: then that, with its gcc/cc."""
    if links_shared_libstdcxx(cxx) is not False:
        return cxx, None, None
    problem = (
        f"the C++ compiler {cxx} links libstdc++ statically into the extension, "
        "beside torch's shared one: an error raised by the compiled kernels would "
        "crash the process"
    )
    for name, c_name in (("g++", "gcc"), ("c++", "cc")):
        alt = os.path.join("/usr/bin", name)
        if (
            os.path.exists(alt)
            and os.path.realpath(alt) != os.path.realpath(cxx)
            and links_shared_libstdcxx(alt)
        ):
            return alt, os.path.join("/usr/bin", c_name), f"{problem}; building with {alt} instead"
    return cxx, None, f"{problem}, and no compiler in /usr/bin links the shared one"
