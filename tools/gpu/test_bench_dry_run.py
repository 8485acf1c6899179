"""``python -m tools.gpu.bench --dry-run-cpu``: the GPU benchmark's whole code path, on CPU.

GPU sessions are rare and short; the script must not fail there for a reason a CPU run
could have shown. The dry run goes through vocabulary loading, trie and reference
construction, the verification of every backend against the float64 oracle (the script
exits 1 on a mismatch), timing and the markdown table, on the reference, cpu and Triton
interpreter backends with a small slice of the Llama-3 vocabulary, at B=1 and at the
batch size of the headline speedup.

The fast tests below check the pieces the figures rest on: the oracle (computed with the
reference's own ancestor matrix, genlm.backend's where it imports) and its column mapping,
the bytes counted as traffic, the peak bandwidth looked up, and the goals' verdicts.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from bench.tries import check_result, make_inputs
from tools.gpu import bench as gpu
from tools.gpu import measure, sweep, trie_reference, trie_vocab
from tools.gpu.goals import GOAL_PEAK_B, GOAL_PEAK_OP, SPEEDUP_B, goals


@pytest.mark.slow
def test_dry_run_verifies_times_and_writes_the_table(tmp_path):
    out = tmp_path / "gpu.md"
    status = gpu.main(
        [
            "--dry-run-cpu",
            "--limit",
            "300",
            "--batch-sizes",
            "1",
            str(SPEEDUP_B),
            "--out",
            str(out),
        ]
    )
    assert status == 0
    text = out.read_text()
    for backend in ("reference", "cpu", "triton"):
        for op in gpu.OPS:
            for B in (1, SPEEDUP_B):
                assert f"| {backend} | {op} | {B} |" in text, (backend, op, B)
    assert "FAILED" not in text
    assert f"Speedup at B={SPEEDUP_B}" in text
    headline = text.split(f"Speedup at B={SPEEDUP_B}")[1].split("Goals")[0]
    for backend in ("reference", "cpu", "triton"):  # the headline rows, both comparisons timed
        line = next(r for r in headline.splitlines() if r.startswith(f"| {backend} | "))
        assert line.count(" ms vs ") == 2 and "- ms" not in line, line
    assert "| oracle | float64, from the reference's ancestor matrix" in text
    where = text.split(f"Where the kernel time goes at B={SPEEDUP_B}")[1].split("Goals")[0]
    for backend in ("reference", "cpu", "triton"):
        for op in gpu.OPS:
            assert f"| {backend} | {op} | `" in where, (backend, op)
    assert "Goals (Llama-3 vocabulary)" in text
    # the memory floors: each goal shape's seven, with the bytes they move (the tile
    # pattern's were checked against plain torch before they were timed)
    floors = text.split("Memory floors")[1].split("\n\n")[1].splitlines()[2:]
    assert len(floors) == 14, floors
    V = 300  # --limit: every token is a column, and a leaf
    N = int(re.search(r"300 tokens, (\d+) nodes", text).group(1))
    for op, B in ((GOAL_PEAK_OP, GOAL_PEAK_B), ("sum", SPEEDUP_B)):
        moved = {
            line.split(" | ")[2]: float(line.split(" | ")[3])
            for line in floors
            if line.startswith(f"| {op} | {B} |")
        }
        assert moved == pytest.approx(
            {
                "write [B, N] once (fill_)": B * N * 4 / 1e6,
                "read [B, V'] once (amax per row)": B * V * 4 / 1e6,
                "read and write [B, V'] (copy_)": 2 * B * V * 4 / 1e6,
                "gather [B, V'] into [B, N] (index_select)": B * (V + N) * 4 / 1e6,
                "write [B, N] as the tile blocks do (32 rows x a tile's ids)": B * N * 4 / 1e6,
                "write [B, N] as blocks of 4 tiles would": B * N * 4 / 1e6,
                "read the staged [B, L], write [B, N], as the tile blocks do": B
                * (V + N)
                * 4
                / 1e6,
            },
            abs=0.006,
        ), moved


@pytest.mark.slow
def test_sweep_verifies_each_configuration_and_restores_the_defaults(tmp_path, monkeypatch):
    from genlm_fast.ops import triton_backend as tb

    defaults = (tb.DOT_ROWS, tb.DOT_WARPS, tb.MAX_ROWS)
    monkeypatch.setattr(
        sweep,
        "TRITON_SWEEP",
        {
            "dot": [
                {"DOT_ROWS": tb.DOT_ROWS, "DOT_WARPS": tb.DOT_WARPS},
                {"DOT_ROWS": 32},
                {"DOT_UB": 0},
            ],  # a chunk of 0 unit ranges cannot launch: reported, not fatal
            "max": [{"MAX_ROWS": 32, "MAX_WARPS": 8}],
        },
    )
    out = tmp_path / "gpu.md"
    assert (
        gpu.main(
            [
                "--dry-run-cpu",
                "--limit",
                "120",
                "--batch-sizes",
                "2",
                "--backends",
                "triton",
                "--ops",
                "sum",
                "max",
                "--sweep",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (tb.DOT_ROWS, tb.DOT_WARPS, tb.MAX_ROWS) == defaults
    section = out.read_text().split("Triton tile-kernel configurations")[1]
    rows = [
        line
        for line in section.splitlines()
        if line.startswith("| sum |") or line.startswith("| max |")
    ]
    assert len(rows) == 4, rows
    assert (
        f"| sum | 2 | dot | DOT_ROWS={tb.DOT_ROWS}, DOT_WARPS={tb.DOT_WARPS} (default) |" in section
    )
    assert "| sum | 2 | dot | DOT_ROWS=32 |" in section  # timed: it passed the oracle
    assert "| sum | 2 | dot | DOT_UB=0 | FAILED: " in section
    assert "| max | 2 | max | MAX_ROWS=32, MAX_WARPS=8 | **" in section  # the only one: fastest


def test_triton_config_sets_and_restores_constants():
    from genlm_fast.ops import triton_backend as tb

    before = tb.DOT_ROWS
    with pytest.raises(RuntimeError), sweep.triton_config(DOT_ROWS=before * 2):
        assert tb.DOT_ROWS == before * 2
        raise RuntimeError
    assert tb.DOT_ROWS == before
    with pytest.raises(AttributeError), sweep.triton_config(NO_SUCH_CONSTANT=1):
        pass


# --------------------------------------------------------------------------- fast checks


@pytest.mark.parametrize(
    "key,name",
    [
        (
            "void genlm_fast::cuda::(anonymous namespace)::tile_kernel<float, float, 2, 8>"
            "(float const*, int const*, long)",
            "tile_kernel<float, float, 2, 8>",
        ),
        ("_tile_ranges_max", "_tile_ranges_max"),
        ("aten::index", "aten::index"),
    ],
)
def test_kernel_names_keep_the_kernel(key, name):
    assert measure.kernel_name(key) == name


@pytest.fixture(scope="module")
def small():
    """(vocab, TokenByteTrie, Reference) on 300 synthetic tokens, on CPU."""
    from genlm_fast.backend.tokenization import Token
    from genlm_fast.bytes import TokenByteTrie

    vocab = [Token(i, b) for i, b in trie_vocab.synthetic_pairs(300)]
    trie = TokenByteTrie(vocab, device="cpu", kernel_backend="reference")
    ref = trie_reference.Reference(vocab, trie.layout, torch.device("cpu"))
    return vocab, trie, ref


def layout_oracle(layout, op, logits, probs):
    """Float64 node values from genlm_fast's own reference backend on its layout (log-masses:
    log of the float64 sum of float64 softmax probabilities): what the benchmark's oracle,
    computed from genlm.backend's ancestor matrix instead, must agree with."""
    from genlm_fast.ops import dispatch

    def f64_reduce(values, reduction):
        out, _ = dispatch.trie_reduce(values.double(), layout, reduction, backend="reference")
        assert out.dtype == torch.float64, out.dtype
        return out.cpu().numpy()

    if op == "log_mass":
        with np.errstate(divide="ignore"):
            return np.log(f64_reduce(torch.softmax(logits.double(), dim=-1), "sum"))
    return f64_reduce(probs, op)


@pytest.mark.parametrize("op", gpu.OPS)
def test_oracle_agrees_with_the_layout_and_catches_a_wrong_node(small, op):
    vocab, trie, ref = small
    logits, probs = make_inputs(len(vocab), 4)
    want = ref.oracle(op, logits, probs)
    assert want.dtype == np.float64 and want.shape[0] == 4
    # genlm.backend's character trie has no EOS node: the columns are mapped, not shifted
    assert want.shape[1] == trie.layout.num_nodes - (1 if ref.char_trie_columns else 0)
    got = layout_oracle(trie.layout, op, logits, probs)
    check_result(got, want, op, byte_trie=ref.char_trie_columns)
    # ... and a node off by 1e-4 (relative) is caught
    bad = got.copy()
    node = trie.layout.root if op != "max" else 0
    bad[1, node] += 1e-4 * abs(bad[1, node]) if op != "log_mass" else 1e-4
    with pytest.raises(AssertionError):
        check_result(bad, want, op, byte_trie=ref.char_trie_columns)
    # the drop-in ParallelTokenCharacterTrie's columns (no EOS node) line up too
    assert ref.char_columns(want).shape[1] == trie.layout.num_nodes - 1


def test_oracle_is_genlm_backends_own_when_it_imports(small):
    import genlm.backend.trie  # noqa: F401  (installed here: the test extra)

    _, _, ref = small
    assert ref.trie is not None and ref.char_trie_columns
    assert "installed package" in ref.source


def test_index_bytes_count_the_arrays_each_backend_reads(small, monkeypatch):
    _, trie, _ = small
    layout = trie.layout
    ml = layout.modes["without_eos"]
    triton = sum(getattr(ml, n).nbytes for n in measure.index_arrays("triton"))
    assert measure.index_bytes(layout, "triton") == triton > 0
    from genlm_fast.ops import extension

    if extension.has("cpu"):  # the CPU kernel's arrays, all of them found
        assert measure.index_bytes(layout, "cpu") > ml.leaf_token.nbytes + layout.parent.nbytes
    monkeypatch.setattr(measure, "index_arrays", lambda backend: ("leaf_token", "no_such_array"))
    with pytest.raises(KeyError, match="no_such_array"):  # never a silent 0
        measure.index_bytes(layout, "triton")


@pytest.mark.parametrize(
    ("name", "gbs"),
    [
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H100 NVL", 3900.0),
        ("NVIDIA H200", 4800.0),
        ("NVIDIA GH200 480GB", 4000.0),
        ("NVIDIA GH200 144G HBM3e", 4900.0),
        ("NVIDIA H200 NVL", 4800.0),
        ("Tesla T4", None),
    ],
)
def test_peak_bandwidth_by_device_name(name, gbs):
    assert measure.detect_peak(name, None) == gbs
    assert measure.detect_peak(name, 1234.0) == 1234.0


def test_goals_verdicts():
    rows = [
        {"backend": "triton", "op": "log_mass", "B": 64, "peak_frac": 0.71, "speedup": 3.0},
        {"backend": "triton", "op": "sum", "B": 32, "peak_frac": 0.5, "speedup": 9.9},
        {"backend": "cuda", "op": "log_mass", "B": 64, "peak_frac": None, "speedup": 2.0},
        {"backend": "cuda", "op": "sum", "B": 32, "failed": "x"},
    ]
    got = {(g["backend"], g["goal"].split(":")[0]): (g["measured"], g["met"]) for g in goals(rows)}
    assert got[("triton", "batch_log_mass B=64")] == ("71%", "yes")
    assert got[("triton", "batch_weight_sum B=32")] == ("9.9x", "NO")
    assert got[("cuda", "batch_log_mass B=64")] == ("-", "-")  # no peak known
    assert got[("cuda", "batch_weight_sum B=32")] == ("-", "-")  # failed: not measured


def test_profile_script_dry_run(capsys):
    """tools/gpu/profile_call.py, which tools/gpu/session.sh runs under ncu on the GPU, runs
    its calls end to end on the CPU (Triton interpreter; the kernels' results are tested
    elsewhere)."""
    from tools.gpu import profile_call as gpu_profile

    assert gpu_profile.main(["--dry-run-cpu", "--op", "sum", "--batch", "2", "--calls", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 calls of triton sum B=2 -> (2, " in out
