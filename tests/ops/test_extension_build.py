"""Focused tests of the compiled trie kernels (``csrc/``, module ``genlm_fast._C``).

* the CPU extension is built and loadable (prebuilt by ``pip install -e .`` or JIT);
* through the dispatcher (``backend="cpu"``) it matches the float64 plain-torch reference on
  small layouts: both trie modes, all reductions, float32/float64 (and half/bfloat16 logits),
  rows wider than the vocabulary, permuted token columns;
* log_mass edge cases: leaves hundreds of nats down (a subtree at log-prob ~-800 gives ~-800,
  not -inf), -1e9 "masks", -inf logits (no NaN);
* max with negative / -inf weights and empty nodes;
* the one-row path that splits the node range over several threads, and the row-parallel path;
* bad input to the raw extension function raises a clear error;
* the build without function multiversioning (what CPUs without AVX2 run) is correct too;
* ``nvcc -c csrc/trie_reduce_cuda.cu`` compiles, also for sm_90 without spills, and the
  -DWITH_CUDA parts of ``csrc/bindings.cpp`` and ``csrc/trie_reduce_cuda_op.cpp`` compile
  against torch's c10/cuda headers (skipped only when nvcc / the CUDA toolkit is absent).

The big cross-backend numerics test lives in test_trie_reduce.py.
"""

from __future__ import annotations

import logging
import os
import re
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

from genlm_fast.ops import cpu_backend, extension, sources, trie_reduce
from tests.layouts import make_layout, random_words

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ["without_eos", "with_eos"]
REDUCTIONS = ["sum", "max", "log_mass"]


# --------------------------------------------------------------------------- helpers


_LAYOUTS = {}


def layout_named(name):
    if name not in _LAYOUTS:
        rng = np.random.default_rng(99)
        if name == "one":
            _LAYOUTS[name] = make_layout([b"a"], eos_positions=[0])
        elif name == "seven":
            _LAYOUTS[name] = make_layout(
                [b"ab", b"a", b"", b"abc", b"b", b"ab", b"ba"], eos_positions=[2, 4]
            )
        elif name == "random":
            words = random_words(rng, 300)
            _LAYOUTS[name] = make_layout(words, rng.choice(len(words), 5, replace=False))
        elif name == "permuted":  # token columns: a permutation inside a wider row
            words = random_words(rng, 150, alphabet=b"xyz", max_len=9)
            cols = rng.permutation(len(words) + 40)[: len(words)]
            _LAYOUTS[name] = make_layout(words, eos_positions=[0, 3], token_column=cols)
        elif name == "big":  # > 32768 nodes: B < threads takes the split-row path
            words = random_words(rng, 7000, alphabet=b"abcdefghijklmnop", max_len=10)
            _LAYOUTS[name] = make_layout(words, rng.choice(len(words), 7, replace=False))
        else:
            raise KeyError(name)
    return _LAYOUTS[name]


def reference(values, layout, reduction, mode):
    return trie_reduce(values, layout, reduction, mode, backend="reference")[0]


def assert_matches(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    tol = 1e-12 if out.dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def random_values(rng, layout, B, reduction, dtype=torch.float32, extra_columns=0):
    C = layout.num_columns + extra_columns
    x = torch.from_numpy(rng.standard_normal((B, C)) * 3)
    if reduction == "sum":
        x = x.abs()
    return x.to(dtype)


def raw_cpu(layout, mode="without_eos"):
    """The raw extension entry point and the arrays it takes."""
    arrays = layout.device_arrays(mode, "cpu", "cpu")
    cpu = cpu_backend.cpu_arrays(arrays)
    module = extension.load_module()
    return module, arrays, cpu


@pytest.fixture(scope="module", autouse=True)
def _cpu_extension():
    if not extension.has("cpu"):
        pytest.fail(f"the CPU trie extension is not available: {extension.why_missing('cpu')}")


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


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", ["one", "seven", "random", "permuted"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference(name, mode, reduction, dtype):
    layout = layout_named(name)
    rng = np.random.default_rng(len(name) * 7 + len(mode))
    for B in (1, 4, 19):  # 19 rows on 2 threads: blocks of 8, 2 and 1 rows
        x = random_values(rng, layout, B, reduction, dtype, extra_columns=3)
        out, used = trie_reduce(x, layout, reduction, mode, backend="cpu")
        assert used == "cpu"
        expected_dtype = (
            torch.float64 if (dtype == torch.float64 and reduction != "log_mass") else torch.float32
        )
        assert out.dtype == expected_dtype
        assert_matches(out, reference(x, layout, reduction, mode))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_log_mass_half_precision_logits(dtype, mode):
    layout = layout_named("random")
    x = random_values(np.random.default_rng(5), layout, 3, "log_mass", dtype)
    x[1, ::7] = float("-inf")
    out, _ = trie_reduce(x, layout, "log_mass", mode, backend="cpu")
    assert_matches(out, reference(x, layout, "log_mass", mode))


def _subtree_nodes(layout, mode, columns):
    """Nodes all of whose leaves are among ``columns`` (and which have leaves)."""
    ml = layout.modes[mode]
    inside = np.isin(ml.leaf_token, np.asarray(sorted(columns)))
    start, end = ml.leaf_start, ml.leaf_end
    csum = np.concatenate([[0], np.cumsum(inside)])
    return np.nonzero((end > start) & (csum[end] - csum[start] == end - start))[0]


@pytest.mark.parametrize("mode", MODES)
def test_log_mass_hundreds_of_nats_down(mode):
    """A subtree whose leaves all sit ~800 nats below the rest keeps its log-mass (~-800),
    mixed with -inf leaves and -1e9 "masked" logits; never -inf or NaN where mass exists."""
    layout = layout_named("random")
    rng = np.random.default_rng(11)
    V = layout.num_columns
    x = torch.from_numpy(rng.standard_normal((3, V)))
    # every token whose column is in `deep` is ~-800 relative to the others
    ml = layout.modes[mode]
    deep_nodes = np.nonzero(ml.leaf_end - ml.leaf_start >= 3)[0]
    node = int(deep_nodes[len(deep_nodes) // 3])
    deep = set(ml.leaf_token[ml.leaf_start[node] : ml.leaf_end[node]].tolist())
    cols = torch.tensor(sorted(deep))
    x[0, cols] = -800.0 + torch.from_numpy(rng.standard_normal(len(cols)))
    x[1, cols] = -1e9  # a "mask" value instead of -inf: still finite mass
    x[2, cols] = -800.0
    x[2, cols[::2]] = float("-inf")  # some of the deep leaves are impossible
    out, _ = trie_reduce(x, layout, "log_mass", mode, backend="cpu")
    ref = reference(x, layout, "log_mass", mode)
    assert_matches(out, ref)
    nodes = _subtree_nodes(layout, mode, deep)
    assert node in nodes
    for row, level in ((0, -800.0), (1, -1e9)):  # row 2 has -inf leaves: see below
        vals = out[row, nodes]
        assert torch.isfinite(vals).all(), (row, vals)
        assert (vals < level + 50).all() and (vals > level - 50 * max(1.0, abs(level) / 800)).all()
    # the node itself: log(sum of exp) of its leaves, about -800 - lse(row)
    lse = torch.logsumexp(x[2].double(), 0)
    leaves = x[2, cols].double()
    expect = torch.logsumexp(leaves, 0) - lse
    assert abs(float(out[2, node]) - float(expect)) < 1e-3
    assert float(expect) < -790


@pytest.mark.parametrize("mode", MODES)
def test_log_mass_neg_inf_logits(mode):
    layout = layout_named("random")
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((2, layout.num_columns))).float()
    x[0, ::2] = float("-inf")
    x[1, 1:] = float("-inf")  # a single possible token
    out, _ = trie_reduce(x, layout, "log_mass", mode, backend="cpu")
    ref = reference(x, layout, "log_mass", mode)
    assert_matches(out, ref)
    assert torch.isneginf(out).any() and not torch.isnan(out).any()
    assert float(out[1, layout.root]) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_negative_and_empty(mode, dtype):
    layout = layout_named("random")
    rng = np.random.default_rng(4)
    x = -torch.from_numpy(rng.random((3, layout.num_columns)) * 10 + 1).to(dtype)
    x[1, ::3] = float("-inf")
    x[2, :] = float("-inf")
    out, _ = trie_reduce(x, layout, "max", mode, backend="cpu")
    assert_matches(out, reference(x, layout, "max", mode))
    ml = layout.modes[mode]
    empty = torch.from_numpy(np.nonzero(ml.leaf_start == ml.leaf_end)[0])
    assert len(empty) > 0  # the EOS node / the re-keyed EOS leaves
    assert (out[:, empty] == 0).all()
    nonempty = torch.from_numpy(np.nonzero(ml.leaf_start < ml.leaf_end)[0])
    assert (out[0, nonempty] < 0).all()
    assert torch.isneginf(out[2, nonempty]).all()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", MODES)
def test_split_row_and_row_parallel_paths(reduction, mode):
    """A trie over 32768 nodes: one row split across 2-4 threads, and several rows."""
    layout = layout_named("big")
    assert layout.num_nodes > 32768
    module, arrays, cpu = raw_cpu(layout, mode)
    rng = np.random.default_rng(8)
    x = random_values(rng, layout, 5, reduction)
    if reduction == "log_mass":
        x[1, ::5] = -900.0  # the exact pass inside the split-row path
        x[2, ::3] = float("-inf")
    ref = reference(x, layout, reduction, mode)
    for threads in (1, 2, 3, 4):
        for rows in (slice(0, 1), slice(1, 2), slice(2, 3), slice(0, 5)):
            out = cpu_backend.run_kernel(
                module, x[rows].contiguous(), arrays, reduction, check=True, num_threads=threads
            )
            assert_matches(out, ref[rows])
    # a NaN row is found by every path (the split-row one checks its column slices)
    bad = x.clone()
    bad[3, -1] = float("nan")
    for threads in (1, 2, 3, 4):
        for rows, name in ((slice(3, 4), 0), (slice(0, 5), 3)):
            with pytest.raises(ValueError, match=f"row {name} contains NaN"):
                cpu_backend.run_kernel(
                    module, bad[rows].contiguous(), arrays, reduction, num_threads=threads
                )


def test_large_results_reuse_memory_only_once_released():
    """Results of >= 16 MiB come from the extension's block pool: a live result (or a numpy
    view of one) is never overwritten by a later call, and a released block is reused."""
    layout = layout_named("big")
    rng = np.random.default_rng(21)
    B = (16 << 20) // (4 * layout.num_nodes) + 3
    xs = [random_values(rng, layout, B, "sum") for _ in range(3)]
    refs = [reference(x, layout, "sum", "without_eos") for x in xs]
    first, _ = trie_reduce(xs[0], layout, "sum", backend="cpu")
    first_view = first.numpy()  # numpy shares the block: it must keep it alive
    first_ptr = first.data_ptr()
    del first
    second, _ = trie_reduce(xs[1], layout, "sum", backend="cpu")
    second_ptr = second.data_ptr()
    assert second_ptr != first_ptr
    assert_matches(torch.from_numpy(first_view), refs[0])
    assert_matches(second, refs[1])
    del first_view, second  # both blocks back in the pool
    third, _ = trie_reduce(xs[2], layout, "sum", backend="cpu")
    assert third.data_ptr() in (first_ptr, second_ptr)  # no fresh mmap: a pooled block
    assert_matches(third, refs[2])
    fourth, _ = trie_reduce(xs[0], layout, "sum", backend="cpu")
    assert fourth.data_ptr() != third.data_ptr()
    assert_matches(fourth, refs[0])
    extension.load_module().empty_output_cache()
    assert_matches(third, refs[2])  # emptying the cache leaves live results alone


def test_result_pool_keeps_the_most_recent_sizes():
    """Once full (4 blocks), the pool makes room for the block just returned by freeing the
    oldest: results of a new trie or batch size get pooled memory from their second call on,
    instead of fresh pages on every call behind a pool full of sizes no longer asked for."""
    layout = layout_named("big")
    module = extension.load_module()
    module.empty_output_cache()
    rng = np.random.default_rng(22)
    rows_per_block = (2 << 20) // (4 * layout.num_nodes) + 1  # each size its own 2 MiB multiple
    base = (16 << 20) // (4 * layout.num_nodes) + 1
    sizes = []
    for k in range(6):
        B = base + k * rows_per_block
        x = random_values(rng, layout, B, "sum")
        out, _ = trie_reduce(x, layout, "sum", backend="cpu")
        nbytes = out.numel() * 4
        sizes.append((nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20))
        assert_matches(out, reference(x, layout, "sum", "without_eos"))
        del out  # back to the pool
        assert module.output_cache_sizes()[-1] == sizes[-1]
    assert len(set(sizes)) == 6
    assert module.output_cache_sizes() == sizes[-4:]
    module.empty_output_cache()
    assert module.output_cache_sizes() == []


# --------------------------------------------------------------------------- bad input


def test_raw_function_rejects_bad_input():
    layout = layout_named("seven")
    module, arrays, cpu = raw_cpu(layout)
    parent, node_of_leaf, leaf_token, empty = (
        arrays["parent"],
        cpu["node_of_leaf"],
        arrays["leaf_token"],
        cpu["empty"],
    )
    x = torch.randn(2, layout.num_columns)

    runs = {
        k: cpu[k]
        for k in ("run_end", "run_depth", "run_child_slot", "run_join_slot", "run_leaf", "run_of")
    }
    max_depth = cpu["max_depth"]
    assert runs["run_end"].numel() < layout.num_nodes  # the layout has links to merge

    def call(
        values=x,
        reduction="sum",
        par=parent,
        ln=node_of_leaf,
        lt=leaf_token,
        em=empty,
        max_dep=max_depth,
        **changed,
    ):
        r = {**runs, **changed}
        return module.trie_reduce_cpu(
            values,
            par,
            ln,
            lt,
            em,
            r["run_end"],
            r["run_depth"],
            r["run_child_slot"],
            r["run_join_slot"],
            r["run_leaf"],
            r["run_of"],
            max_dep,
            reduction,
            True,
            0,
        )

    out, bad_row = call()
    assert out.shape == (2, layout.num_nodes) and bad_row == -1
    with pytest.raises(RuntimeError, match="unknown reduction"):
        call(reduction="mean")
    with pytest.raises(RuntimeError, match="2-D"):
        call(values=x[0])
    with pytest.raises(RuntimeError, match="contiguous"):
        call(values=torch.randn(layout.num_columns, 2).t())
    with pytest.raises(RuntimeError, match="float32 or float64"):
        call(values=x.half())
    with pytest.raises(RuntimeError, match="float16, bfloat16, float32 or float64"):
        call(values=x.long(), reduction="log_mass")
    with pytest.raises(RuntimeError, match="float64_result is for sum and max"):
        module.trie_reduce_cpu(
            x,
            parent,
            node_of_leaf,
            leaf_token,
            empty,
            *runs.values(),
            max_depth,
            "log_mass",
            True,
            0,
            True,
        )
    wide, _ = module.trie_reduce_cpu(
        x, parent, node_of_leaf, leaf_token, empty, *runs.values(), max_depth, "sum", True, 0, True
    )
    assert wide.dtype == torch.float64
    assert torch.equal(wide, call(values=x.double())[0])
    with pytest.raises(RuntimeError, match="'parent' must be int32"):
        call(par=parent.long())
    with pytest.raises(RuntimeError, match="'run_of' must be int32"):
        call(run_of=runs["run_of"].long())
    with pytest.raises(RuntimeError, match="outside the"):
        call(values=x[:, :2].contiguous())  # fewer columns than the vocabulary
    bad_parent = parent.clone()
    bad_parent[0] = 0
    with pytest.raises(RuntimeError, match="post-order parent"):
        call(par=bad_parent)
    with pytest.raises(RuntimeError, match="> max_depth"):
        call(max_dep=max_depth - 1)
    # the runs: each malformed in one way
    end, depth, child, join, leaf, run_of = (runs[k] for k in runs)
    with pytest.raises(RuntimeError, match="run arrays need"):
        call(run_depth=depth[:-1].contiguous())
    with pytest.raises(RuntimeError, match="run_end must increase to N"):
        call(run_end=torch.cat([end[:-1], end[-1:] - 1]).contiguous())
    with pytest.raises(RuntimeError, match="run_of\\[0\\]"):
        call(run_of=(run_of + 1).to(torch.int32))
    first_run = (torch.arange(len(depth)) == 0).to(torch.int32)
    with pytest.raises(RuntimeError, match="run 0 has run_depth"):
        call(run_depth=(depth + first_run).to(torch.int32))
    # a stack slot other than the identity slot (max_depth + 1) for a run without children
    # (run 0) and for a first child (run 0 again), or the identity slot for a later sibling
    assert child[0] == join[0] == max_depth + 1
    with pytest.raises(RuntimeError, match="run_child_slot 0"):
        call(run_child_slot=(child - (max_depth + 1) * first_run).to(torch.int32))
    with pytest.raises(RuntimeError, match="run_join_slot 0"):
        call(run_join_slot=(join - (max_depth + 1) * first_run).to(torch.int32))
    later = int(torch.nonzero(join <= max_depth)[0])  # a run that joins earlier siblings
    with pytest.raises(RuntimeError, match=f"run {later} has .* run_join_slot {max_depth + 1}"):
        call(
            run_join_slot=torch.where(torch.arange(len(join)) == later, max_depth + 1, join).to(
                torch.int32
            )
        )
    with pytest.raises(RuntimeError, match="run_leaf must start at 0"):
        call(run_leaf=(leaf + 1).to(torch.int32))
    with_leaves = int(torch.nonzero(leaf[1:] > leaf[:-1])[0])  # a run with a leaf
    shifted = leaf.clone()
    shifted[with_leaves + 1] -= 1  # its last leaf listed under the next run
    with pytest.raises(RuntimeError, match="is listed under run"):
        call(run_leaf=shifted)
    # runs 0 and 1 merged into one: node end[0] starts its own run, it is no link
    merged_of = (run_of - (run_of >= 1).to(torch.int32)).to(torch.int32)
    with pytest.raises(RuntimeError, match="not the single-child parent"):
        call(
            run_end=end[1:].contiguous(),
            run_depth=depth[1:].contiguous(),
            run_child_slot=child[1:].contiguous(),
            run_join_slot=join[1:].contiguous(),
            run_leaf=torch.cat([leaf[:1], leaf[2:]]).contiguous(),
            run_of=merged_of,
        )
    with pytest.raises(RuntimeError, match="non-decreasing"):
        call(ln=node_of_leaf.flip(0).contiguous())
    with pytest.raises(RuntimeError, match="node_of_leaf has"):
        call(ln=node_of_leaf[:-1].contiguous())
    # rows the kernel rejects are reported, not raised: the first one's index comes back
    for reduction, value in (
        ("sum", "nan"),
        ("max", "nan"),
        ("log_mass", "nan"),
        ("log_mass", "inf"),
        ("log_mass", "all -inf"),
    ):
        bad = torch.randn(3, layout.num_columns + 5)
        if value == "all -inf":
            bad[1] = float("-inf")
        else:
            bad[1, -1] = float(value)  # a column past the vocabulary: still checked
        bad[2, 0] = float("nan")
        assert call(values=bad, reduction=reduction)[1] == 1, (reduction, value)
    with pytest.raises(TypeError):
        module.trie_reduce_cpu(x, parent, node_of_leaf, leaf_token, empty, max_depth)


def test_backend_rejects_narrow_rows_after_checking_once():
    """Called directly (not through the dispatcher), after its first call has checked the
    indices, the backend must still not read a row too narrow past its end."""
    layout = layout_named("permuted")
    arrays = layout.device_arrays("without_eos", "cpu", "cpu")
    wide = torch.rand(1, layout.num_columns)
    cpu_backend.trie_reduce(wide, arrays, "sum", num_nodes=layout.num_nodes)
    assert cpu_backend.cpu_arrays(arrays)["checked"]
    with pytest.raises(ValueError, match="at least"):
        cpu_backend.trie_reduce(
            wide[:, :-1].contiguous(), arrays, "sum", num_nodes=layout.num_nodes
        )


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


# --------------------------------------------------------------------------- CUDA source


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
    # a CPU torch's cpp_extension.CUDA_HOME is None: ask nvcc where its headers are
    dry = subprocess.run(
        [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    cuda_includes = re.findall(
        r'-I"?([^"\s]+)',
        "".join(line for line in dry.stderr.splitlines() if line.startswith("#$ INCLUDES=")),
    )
    assert cuda_includes, dry.stderr
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
