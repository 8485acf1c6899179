"""nvcc compiles the CUDA sources (skipped only when nvcc / the CUDA toolkit is absent).

``nvcc -c csrc/trie_reduce_cuda.cu`` compiles, also for sm_90 without spills; in the sm_90
PTX each kernel launched dependent on the one before it waits for that one before touching
its results; the -DWITH_CUDA parts of ``csrc/bindings.cpp`` and ``csrc/trie_reduce_cuda_op.cpp``
compile against torch's c10/cuda headers. The oracle is the compiler itself (its exit status,
ptxas' resource report, the PTX); nothing runs here: the kernels' results are checked on the
CPU under an emulator (test_cuda_emulation.py) and on a GPU (test_trie_reduce.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig

import pytest

from tests.ops.cuda_toolkit import cuda_include_dirs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CUDA_SOURCE = os.path.join(REPO, "csrc", "trie_reduce_cuda.cu")


class _Compile:
    """A compiler run started in the background (its output in a file): the module's
    compiles are independent, single-threaded and long, so they run side by side."""

    def __init__(self, cmd, log):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def result(self, timeout=600):
        """The compiler's output; fails the test on a non-zero exit status."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        with open(self.log) as f:
            output = f.read()
        assert self.proc.returncode == 0, output[-6000:]
        return output


def _nvcc(log, *args):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    return _Compile([nvcc, "-std=c++17", "-O3", *args], log)


@pytest.fixture(scope="module")
def nvcc_compiles(tmp_path_factory):
    """The three nvcc runs of the tests below, started together: the .cu alone for nvcc's
    default target; one sm_90 (H100/H200) compile as the extension builds it (-DWITH_CUDA),
    keeping its intermediates: the object, ptxas' resource report and the PTX (the one
    `-ptx` would write: the same front end, the same compute_90 target); the sm_80 PTX."""
    build = tmp_path_factory.mktemp("nvcc")
    keep = build / "keep"
    keep.mkdir()
    paths = {
        "standalone": build / "standalone.o",
        "sm90": build / "trie_reduce_cuda.o",
        "sm80_ptx": build / "sm_80.ptx",
    }
    runs = {
        "standalone": _nvcc(
            build / "standalone.log", "-c", CUDA_SOURCE, "-o", str(paths["standalone"])
        ),
        "sm90": _nvcc(
            build / "sm90.log",
            "-DWITH_CUDA",
            "-arch=sm_90",
            "-Xptxas",
            "-v",
            "-keep",
            "-keep-dir",
            str(keep),
            "-c",
            CUDA_SOURCE,
            "-o",
            str(paths["sm90"]),
        ),
        "sm80_ptx": _nvcc(
            build / "sm80.log", "-arch=sm_80", "-ptx", CUDA_SOURCE, "-o", str(paths["sm80_ptx"])
        ),
    }
    yield {"runs": runs, "paths": paths, "keep": keep}
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


@pytest.fixture(scope="module")
def sm90_build(nvcc_compiles):
    """The sm_90 compile's object, ptxas' resource report and PTX."""
    report = nvcc_compiles["runs"]["sm90"].result()
    return {
        "obj": nvcc_compiles["paths"]["sm90"],
        "report": report,
        "ptx": (nvcc_compiles["keep"] / "trie_reduce_cuda.ptx").read_text(),
    }


def test_cuda_source_compiles_standalone(nvcc_compiles):
    """nvcc's default target, the .cu alone (`nvcc -c`, no defines), as trie_reduce_cuda.h
    promises."""
    nvcc_compiles["runs"]["standalone"].result()
    obj = nvcc_compiles["paths"]["standalone"]
    assert obj.exists() and obj.stat().st_size > 0


def test_cuda_source_compiles_for_sm90_without_spills(sm90_build):
    """sm_90 with ptxas' resource report: no spills."""
    obj, report = sm90_build["obj"], sm90_build["report"]
    assert obj.exists() and obj.stat().st_size > 0
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert spills, report  # one line per kernel
    assert all(int(n) == 0 for n in spills), report


def test_cuda_dependent_kernels_wait_before_touching_results(nvcc_compiles, sm90_build):
    """Programmatic dependent launch (sm_90): the kernels launched dependent on the one
    before them, (a2) row_lse_merge, (b) tile and (c) span, may start while it still runs.
    In their sm_90 PTX, griddepcontrol.wait must come before their first float64 global
    load (the scratch: partials, lse, tile totals), before the tile kernel's first load of
    staged values (ld.global.cg: what (a1) wrote) and before their first global store
    (scratch and output); the kernels that let the next one start early say so
    (griddepcontrol.launch_dependents). Below sm_90 there is neither (the host then launches
    as usual: ptxVersion < 90)."""
    nvcc_compiles["runs"]["sm80_ptx"].result()
    ptx = {"sm_80": nvcc_compiles["paths"]["sm80_ptx"].read_text(), "sm_90": sm90_build["ptx"]}
    assert "griddepcontrol" not in ptx["sm_80"]
    entries = re.split(r"\n(?=(?:\.visible )?\.entry )", ptx["sm_90"])[1:]
    seen = set()
    for body in entries:
        name = re.search(
            r"(row_lse_merge_kernel|row_pass_kernel|tile_kernel|span_kernel)", body
        ).group(1)
        seen.add(name)
        wait = body.find("griddepcontrol.wait")
        first_store = re.search(r"st\.global", body).start()
        loads = re.search(r"ld\.global[.\w]*\.f64", body)
        if name == "row_pass_kernel":  # the first kernel of a call: nothing to wait for
            assert wait < 0
        else:
            assert 0 <= wait < first_store, name
            assert loads is None or wait < loads.start(), name
        if name == "tile_kernel":
            assert 0 <= wait < body.index("ld.global.cg"), name
        if name != "span_kernel":
            assert "griddepcontrol.launch_dependents" in body, name
    assert seen == {"row_lse_merge_kernel", "row_pass_kernel", "tile_kernel", "span_kernel"}


def test_cuda_bindings_compile(tmp_path):
    """The -DWITH_CUDA parts of csrc/bindings.cpp and csrc/trie_reduce_cuda_op.cpp (CUDA
    guard, stream, launch) against torch's real c10/cuda headers: a syntax and type check
    with the host compiler, as the CUDA build would compile them. The CPU torch wheel lacks
    one generated header, c10/cuda/impl/cuda_cmake_macros.h; a CUDA build's copy only
    defines C10_CUDA_BUILD_SHARED_LIBS, so the test writes that."""
    from torch.utils import cpp_extension

    cxx = shutil.which("c++") or shutil.which("g++")
    nvcc = shutil.which("nvcc")
    if cxx is None or nvcc is None:
        pytest.skip("needs a C++ compiler and nvcc's CUDA toolkit (for cuda_runtime_api.h)")
    cuda_includes = cuda_include_dirs()
    assert cuda_includes, "nvcc names no include directory holding cuda_fp16.h"
    shim = tmp_path / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [
        str(tmp_path),
        *cpp_extension.include_paths(),
        *cuda_includes,
        sysconfig.get_paths()["include"],
        os.path.join(REPO, "csrc"),
    ]
    cmd = [
        cxx,
        "-std=c++17",
        "-fsyntax-only",
        "-DWITH_CUDA",
        "-DTORCH_EXTENSION_NAME=_C",
        *(f"-I{p}" for p in includes),
    ]
    checks = [  # side by side
        _Compile([*cmd, os.path.join(REPO, "csrc", source)], tmp_path / f"{source}.log")
        for source in ("bindings.cpp", "trie_reduce_cuda_op.cpp")
    ]
    for check in checks:
        check.result()
