"""Building and loading the compiled trie kernels (``csrc/``, module ``genlm_fast._C``).

* the CPU extension is built and loadable (prebuilt by ``pip install -e .`` or JIT); a
  prebuilt module older than csrc/ is reported, a failed JIT build is remembered across
  processes, a missing compiler fails fast, builders of one folder take turns; the
  dispatcher's fallback warning and its choice of backend on a GPU;
* the build without function multiversioning (what CPUs without AVX2 run) matches the
  float64 plain-torch reference (tests/ops/extension_cases.py), built with /usr/bin/g++ in
  place of a compiler that links libstdc++ statically, so it shares torch's libstdc++.

The kernels' numerics: test_extension_numerics.py; nvcc compiling the CUDA sources:
test_cuda_compile.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import types
import warnings

import numpy as np
import pytest
import torch

from genlm_fast.ops import cpu_backend, extension, sources
from tests.ops.devices import cpu_extension_required as cpu_extension_required  # autouse
from tests.ops.extension_cases import (
    MODES,
    REDUCTIONS,
    assert_matches,
    layout_named,
    random_values,
    reference,
)

# --------------------------------------------------------------------------- build / load


def test_extension_is_built_and_reported():
    assert extension.has("cpu")
    assert extension.why_missing("cpu") == ""
    assert extension.origin() is not None
    assert not extension.has("tpu") and "unknown" in extension.why_missing("tpu")
    if not torch.cuda.is_available():
        assert not extension.has("cuda")
        assert extension.why_missing("cuda")  # a reason, never an exception
    from genlm_fast.ops import available_backends, resolve_backend

    assert "cpu" in available_backends("cpu")
    assert resolve_backend("auto", "cpu") == "cpu"
    if extension.origin() == "prebuilt":  # setup.py stamped it with the digest of csrc/
        stamp = os.path.join(os.path.dirname(extension.load_module().__file__), "_C.sources")
        assert open(stamp).read().strip() == sources.digest()
        assert extension.stale_reason() == ""


def test_a_prebuilt_module_older_than_csrc_is_reported(tmp_path):
    """An editable install keeps loading its old build after csrc/ is edited: the digest
    setup.py stamped beside it tells; no stamp (or no csrc/) is no verdict."""
    module = types.SimpleNamespace(__file__=str(tmp_path / "_C.so"))
    assert extension._stale_reason(module) == ""
    (tmp_path / "_C.sources").write_text(sources.digest() + "\n")
    assert extension._stale_reason(module) == ""
    (tmp_path / "_C.sources").write_text("0" * 64 + "\n")
    assert "rebuild it with `pip install -e . --no-build-isolation`" in extension._stale_reason(
        module
    )
    edited = tmp_path / "csrc"
    shutil.copytree(sources.CSRC, edited)
    before = sources.digest(str(edited))
    with open(edited / "trie_reduce_cpu.cpp", "a") as f:
        f.write("// edited\n")
    assert sources.digest(str(edited)) != before
    assert sources.digest(str(tmp_path / "no-csrc")) is None


def _failing_compiler(tmp_path, message="fatal error: omp.h: No such file or directory"):
    """A C++ "compiler" that fails every compilation (as clang without libomp does) and
    counts its compilations in calls.txt; anything else (``--version``, ...) goes to g++."""
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("needs g++ for the compiler probes torch runs")
    calls = tmp_path / "calls.txt"
    script = tmp_path / "bin" / "g++"
    script.parent.mkdir()
    script.write_text(f"""#!/bin/sh
for a in "$@"; do
  if [ "$a" = "-c" ]; then echo x >> "{calls}"; echo "src.cpp:1:10: {message}" >&2; exit 1; fi
done
exec {gxx} "$@"
""")
    script.chmod(0o755)
    return script, calls


def _count(calls):
    return len(calls.read_text().splitlines()) if calls.exists() else 0


@pytest.mark.timeout(240)
def test_a_failed_jit_build_is_remembered_across_processes(tmp_path, monkeypatch, caplog):
    """A build that fails (here: no omp.h) reports the compiler's error line, not ninja's
    "build stopped", and is not retried by every later process (a minute each when the
    compilation itself is slow) until the sources, flags or compiler change; a leftover
    torch build lock from a killed build is removed at once, not after minutes."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        pytest.skip("ninja is not installed")
    from torch.utils._cpp_extension_versioner import ExtensionVersioner

    def new_process():  # torch never rebuilds a module twice in one process
        monkeypatch.setattr(cpp_extension, "JIT_EXTENSION_VERSIONER", ExtensionVersioner())

    script, calls = _failing_compiler(tmp_path)
    monkeypatch.setenv("GENLM_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(script))
    defines = ("GF_TEST_FAILING_BUILD",)
    build_dir = tmp_path / "cache" / "ext" / extension.build_tag("-GF_TEST_FAILING_BUILD")
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # a killed build's lock, made just now
    start = time.monotonic()
    new_process()
    with pytest.raises(RuntimeError) as first:
        extension._jit_build(defines=defines)
    assert time.monotonic() - start < 120  # no waiting out the leftover lock
    assert not (build_dir / "lock").exists()
    summary = extension.summarize_error(first.value)
    assert "omp.h" in summary and "build stopped" not in summary
    compiled = _count(calls)
    assert compiled >= 1
    # the next process gets the same error without compiling
    new_process()
    with pytest.raises(RuntimeError, match="omp.h.*remembered.*failed.txt"):
        extension._jit_build(defines=defines)
    assert _count(calls) == compiled
    # a different compiler (here: the same script, touched) is tried again
    later = time.time() + 5
    os.utime(script, (later, later))
    new_process()
    with pytest.raises(RuntimeError, match="Error building"):
        extension._jit_build(defines=defines)
    assert _count(calls) > compiled


def test_no_compiler_fails_fast_with_a_clear_reason(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GENLM_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with (
        caplog.at_level("WARNING", logger="genlm_fast.ops"),
        pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"),
    ):
        extension._jit_build(defines=("GF_TEST_NO_COMPILER",))
    assert "compiling" not in caplog.text  # no "about a minute" announcement for nothing


def test_the_build_lock_serializes_builders(tmp_path):
    """Two builders of one folder: the second waits for the first (an flock, which the
    kernel releases when its holder dies, so it never goes stale)."""
    import threading

    order = []
    (tmp_path / "lock").touch()  # torch's lock, left by a killed build: removed under ours
    with extension._BuildLock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()

        def second():
            with extension._BuildLock(str(tmp_path)):
                order.append("second")

        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.5)
        order.append("first done")
    thread.join(10)
    assert order == ["first done", "second"]


def test_jit_cache_folder_names_the_python_abi_and_torch():
    tag = extension.build_tag()
    assert sysconfig.get_config_var("SOABI") in tag
    assert torch.__version__.replace("+", "_") in tag


def test_fallback_warning_says_why_and_how(monkeypatch):
    """ "auto" ending on the reference warns once, with the reason the compiled kernels are
    missing and a command that builds them (plain `pip install -e .` builds in isolation,
    without torch, so without the kernels)."""
    from genlm_fast.ops import dispatch

    monkeypatch.setattr(extension, "has", lambda kind: False)
    monkeypatch.setattr(
        extension,
        "why_missing",
        lambda kind: "REASON-XYZ; run `pip install -e . --no-build-isolation`",
    )
    monkeypatch.setattr(dispatch, "_warned", set())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        chosen = [dispatch.resolve_backend("auto", "cpu") for _ in range(2)]
    assert chosen == ["reference", "reference"]
    record = [w for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(record) == 1  # once per process and device
    text = str(record[0].message)
    assert "REASON-XYZ" in text and "--no-build-isolation" in text and "reference" in text


@pytest.mark.parametrize("built", [("triton", "cuda"), ("triton",), ("cuda",), ()])
def test_auto_on_a_gpu_picks_the_first_available(monkeypatch, built):
    """On a CUDA device "auto" takes, for every reduction, the first of GPU_PREFERENCE that
    is available (CUDA, the faster for every op on the H100 and the H200), the other one
    when only it is, and the reference (with a warning) when neither is."""
    from genlm_fast.ops import dispatch

    monkeypatch.setattr(dispatch, "triton_usable", lambda device: "triton" in built)
    monkeypatch.setattr(
        dispatch, "_extension_usable", lambda kind, device: kind == "cuda" and "cuda" in built
    )
    monkeypatch.setattr(dispatch, "_warned", set())
    assert dispatch.GPU_PREFERENCE == ("cuda", "triton")
    for reduction in dispatch.REDUCTIONS:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            chosen = dispatch.resolve_backend("auto", "cuda", reduction)
        want = "cuda" if "cuda" in built else built[0] if built else "reference"
        assert chosen == want, reduction
        assert any("reference" in str(w.message) for w in record) == (want == "reference")
        monkeypatch.setattr(dispatch, "_warned", set())
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        dispatch.resolve_backend("auto", "cuda", "mean")


def test_triton_interpreter_switched_on_after_the_kernels_were_imported(monkeypatch):
    """TRITON_INTERPRET=1 set after the Triton kernels were defined for the GPU does not
    make them run on CPU tensors: "triton" is not offered there, and asking for it says why
    (instead of triton's "0 active drivers" from inside the kernel launch)."""
    import sys
    import types

    from genlm_fast.ops import dispatch

    pytest.importorskip("triton")
    JITFunction = type("JITFunction", (), {})  # what triton.jit made without the interpreter
    fake = types.ModuleType("genlm_fast.kernels.trie_reduce")
    fake.kernel = JITFunction()
    monkeypatch.setitem(sys.modules, "genlm_fast.kernels.trie_reduce", fake)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "triton" not in dispatch.available_backends("cpu")
    with pytest.raises(RuntimeError, match="after genlm_fast's Triton kernels"):
        dispatch.resolve_backend("triton", "cpu")
    InterpretedFunction = type("InterpretedFunction", (), {})
    fake.kernel = InterpretedFunction()
    assert "triton" in dispatch.available_backends("cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.resolve_backend("triton", "cpu")
    with pytest.raises(ValueError, match="Unknown trie backend"):
        dispatch.resolve_backend("tpu", "cpu")


# --------------------------------------------------------------------------- baseline build


def _static_libstdcxx_compiler(tmp_path):
    """A g++ that links libstdc++ statically (as /opt/gcc on an H200 machine did), or None
    where this machine cannot make one (no g++, no libstdc++.a, no readelf)."""
    gxx = shutil.which("g++")
    if gxx is None or shutil.which("readelf") is None:
        return None
    archive = subprocess.run(
        [gxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if not os.path.isabs(archive):
        return None
    fake = tmp_path / "static-g++"
    fake.write_text(f'#!/bin/sh\nexec {gxx} -static-libstdc++ "$@"\n')
    fake.chmod(0o755)
    return str(fake)


def test_a_compiler_that_links_libstdcxx_statically_is_replaced(tmp_path):
    """A private static libstdc++ in the extension beside torch's shared one crashed the
    process on the H200 as soon as an error message formatted a number: such a compiler is
    recognised, and a /usr/bin one that links the shared libstdc++ is taken instead."""
    static = _static_libstdcxx_compiler(tmp_path)
    if static is None or not os.path.exists("/usr/bin/g++"):
        pytest.skip("needs g++ (with /usr/bin/g++), its libstdc++.a and readelf")
    gxx = shutil.which("g++")
    assert sources.links_shared_libstdcxx(gxx) is True
    assert sources.links_shared_libstdcxx(static) is False
    assert sources.links_shared_libstdcxx(str(tmp_path / "no-such-compiler")) is None
    assert sources.choose_compilers(gxx) == (gxx, None, None)
    cxx, cc, note = sources.choose_compilers(static)
    assert (cxx, cc) == ("/usr/bin/g++", "/usr/bin/gcc")
    assert f"{static} links libstdc++ statically" in note and "building with /usr/bin/g++" in note


def test_environ_set_restores_the_variable(monkeypatch):
    """The JIT build's $CXX swap leaves $CXX as it found it: set, absent, or after an error."""
    monkeypatch.delenv("GF_TEST_VAR", raising=False)
    with extension._environ_set("GF_TEST_VAR", "inner"):
        assert os.environ["GF_TEST_VAR"] == "inner"
    assert "GF_TEST_VAR" not in os.environ
    monkeypatch.setenv("GF_TEST_VAR", "outer")
    with pytest.raises(KeyError), extension._environ_set("GF_TEST_VAR", "inner"):
        raise KeyError("build failed")
    assert os.environ["GF_TEST_VAR"] == "outer"
    with extension._environ_set("GF_TEST_VAR", None):
        assert os.environ["GF_TEST_VAR"] == "outer"


def test_the_extension_shares_torchs_libstdcxx():
    """genlm_fast._C (or the JIT-built module) needs the shared libstdc++, like torch."""
    module = extension.load_module()
    if module is None or shutil.which("readelf") is None:
        pytest.skip("no compiled extension here, or no readelf")
    assert sources.needs_shared_libstdcxx(module.__file__) is True, module.__file__


# the trie op alone (its sources only: the other ops have no multiversioned code)
BASELINE_TRIE_ONLY = ("GF_BASELINE_ONLY", "GF_TRIE_ONLY")


def test_baseline_build_matches_reference(tmp_path, monkeypatch, caplog):
    """The kernels built without function multiversioning (-DGF_BASELINE_ONLY): the code an
    x86-64 without AVX2 runs (vector lanes split into SSE2 halves, the plain expand_runs
    loop), which the AVX2 clones otherwise hide on this machine. The trie op's sources alone
    (-DGF_TRIE_ONLY), built once into the JIT cache, with $CXX a g++ that links libstdc++
    statically where one can be made: the JIT build takes /usr/bin/g++ instead, says so, and
    the module shares torch's libstdc++."""
    static = _static_libstdcxx_compiler(tmp_path)
    if static is not None and os.path.exists("/usr/bin/g++"):
        monkeypatch.setenv("CXX", static)
    configured = os.environ.get("CXX")
    with caplog.at_level(logging.WARNING, logger="genlm_fast"):
        module, where = extension._jit_build(defines=BASELINE_TRIE_ONLY)
    assert os.environ.get("CXX") == configured  # the replacement compiler was for the build only
    if configured == static:
        assert sources.needs_shared_libstdcxx(module.__file__) is True
        assert f"{static} links libstdc++ statically" in caplog.text
    rng = np.random.default_rng(17)
    for name in ("random", "big"):
        layout = layout_named(name)
        for mode in MODES:
            arrays = layout.device_arrays(mode, "cpu", "cpu")
            for reduction in REDUCTIONS:
                for dtype in (torch.float32, torch.float64):
                    x = random_values(rng, layout, 15, reduction, dtype, extra_columns=2)
                    if reduction == "log_mass":
                        x[2, ::4] = -800.0  # the exact low pass
                    ref = reference(x, layout, reduction, mode)
                    # 15 rows: blocks of 8, 4, 2 and 1 rows; one row on 2 threads: split
                    for rows, threads in ((slice(0, 15), 1), (slice(2, 3), 2)):
                        out = cpu_backend.run_kernel(
                            module,
                            x[rows].contiguous(),
                            arrays,
                            reduction,
                            check=True,
                            num_threads=threads,
                        )
                        assert_matches(out, ref[rows])
    # a read-only cache that holds this build is loaded as it is, without a compiler (in a
    # new process: an extension module initialises once per process)
    script = """
import os, sys
from torch.utils import cpp_extension
from genlm_fast.ops import extension
def no_build(*a, **k):
    raise AssertionError("compiled")
cpp_extension.load = no_build
writable = os.access
os.access = lambda path, mode: False if mode == os.W_OK else writable(path, mode)
module, where = extension._jit_build(defines=("GF_BASELINE_ONLY", "GF_TRIE_ONLY"))
print(where, hasattr(module, "trie_reduce_cpu"), hasattr(module, "DecoderCPU"))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [where, "True", "False"]  # the trie op alone
