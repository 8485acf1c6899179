"""The Triton kernels compile for the GPUs we target (sm_90: H100, H200), here, with no GPU.

The interpreter tests (``TRITON_INTERPRET=1``) check what the kernels compute but never
compile them. This compiles every kernel configuration that ``genlm_fast.ops`` launches on
CUDA through Triton's real pipeline (TTIR -> TTGIR -> PTX -> cubin with Triton's bundled
ptxas) and reads the cubin's resource usage with the bundled ``cuobjdump``. A kernel that
the GPU compiler rejects, that spills more than a few registers, or that needs more shared
memory than an SM has fails here, before a session with a GPU.

The compiles run in a subprocess: ``@triton.jit`` builds interpreter objects when
``TRITON_INTERPRET`` is set, as it is for the test session on a machine without a GPU.
Pointer arguments are declared 16-byte aligned, as torch's allocations are at run time.

For the table: ``python tests/ops/test_triton_sm90.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

SM90_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may opt into
MAX_STACK = 64  # bytes of per-thread stack (spills) tolerated

# Input dtype per reduction, as the dispatcher passes them to the Triton backend.
TRIE_CASES = [
    ("log_mass", "fp32"),
    ("log_mass", "bf16"),
    ("log_mass", "fp16"),
    ("log_mass", "fp64"),
    ("sum", "fp32"),
    ("sum", "fp64"),
    ("max", "fp32"),
    ("max", "fp64"),
]
CAPTURE_DTYPES = ["fp32", "bf16", "fp16"]  # logits the vLLM capture kernel reads


def _configs():
    """(name, kernel, signature, constexprs, num_warps) for every launch of
    ``genlm_fast.ops.triton_backend`` and ``genlm_fast.ops.log_softmax`` on CUDA."""
    import torch
    import triton.language as tl

    from genlm_fast.kernels import log_softmax_rows as capture
    from genlm_fast.kernels import trie_reduce as k
    from genlm_fast.ops import layout, log_softmax
    from genlm_fast.ops import triton_backend as tb
    from genlm_fast.ops.dispatch import result_dtype

    tl_acc = {"fp32": tl.float32, "fp64": tl.float64}
    torch_dtype = {
        "fp32": torch.float32,
        "fp64": torch.float64,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
    }
    idx = "*i32"  # the layout's index arrays (TrieLayout.device_arrays)
    out = []
    for reduction, x in TRIE_CASES:
        acc = "fp64" if x == "fp64" else "fp32"
        res = "fp64" if result_dtype(reduction, torch_dtype[x]) == torch.float64 else "fp32"
        part = acc if reduction == "log_mass" else res  # pmax/psum (else unused: out)
        split = tb.LSE_MAX_SPLIT if reduction == "log_mass" else 1
        tag = f"{reduction}/{x}"
        if reduction == "log_mass":
            out.append(
                (
                    f"_row_lse_partial {tag}",
                    k._row_lse_partial,
                    {
                        "x_ptr": f"*{x}",
                        "pmax_ptr": f"*{acc}",
                        "psum_ptr": f"*{acc}",
                        "C": "i32",
                        "chunk": "i32",
                    },
                    {"SPLIT": split, "BLOCK": tb.LSE_BLOCK, "ACC": tl_acc[acc]},
                    4,
                )
            )
        tile_args = {
            "x_ptr": f"*{x}",
            "B": "i32",
            "C": "i32",
            "L": "i32",
            "leaf_token_ptr": idx,
            "range_ptr_ptr": idx,
            "unit_end_ptr": idx,
            "range_start_ptr": idx,
            "range_end_ptr": idx,
            "range_dest_ptr": idx,
            "out_ptr": f"*{res}",
            "N": "i32",
            "scratch_ptr": f"*{res}",
            "NS": "i32",
            "pmax_ptr": f"*{part}",
            "psum_ptr": f"*{part}",
        }
        kind = tb.tile_kernel(reduction, torch_dtype[x])
        if kind == "max":
            out.append(
                (
                    f"_tile_ranges_max {tag}",
                    k._tile_ranges_max,
                    {n: t for n, t in tile_args.items() if n not in ("pmax_ptr", "psum_ptr")},
                    {"TILE": layout.TILE, "ROWS": tb.MAX_ROWS, "RB": tb.MAX_RB},
                    tb.MAX_WARPS,
                )
            )
        elif kind == "dot":
            rows, warps = tb.DOT_ROWS, tb.DOT_WARPS
            out.append(
                (
                    f"_tile_ranges_dot {tag}",
                    k._tile_ranges_dot,
                    tile_args,
                    {
                        "LOG_MASS": reduction == "log_mass",
                        "SPLIT": split,
                        "TILE": layout.TILE,
                        "ROWS": rows,
                        "RB": tb.DOT_RB,
                        "UB": tb.DOT_UB,
                        "SUB": tb.DOT_SUB,
                        "ACC": tl_acc[acc],
                        "FAST_MIN_MASS": k._FAST_MIN_MASS,
                        "LEVEL_GAP": k._LEVEL_GAP,
                    },
                    warps,
                )
            )
        dense_args = {n: t for n, t in tile_args.items() if n not in ("B", "unit_end_ptr")}
        out.append(
            (
                f"_tile_ranges_dense {tag}",
                k._tile_ranges_dense,
                dense_args,
                {
                    "REDUCTION": tb._CODES[reduction],
                    "SPLIT": split,
                    "TILE": layout.TILE,
                    "RB": tb.DENSE_RB,
                    "ACC": tl_acc[acc],
                },
                4,
            )
        )
        out.append(
            (
                f"_spanning_nodes {tag}",
                k._spanning_nodes,
                {
                    "scratch_ptr": f"*{res}",
                    "NS": "i32",
                    "out_ptr": f"*{res}",
                    "N": "i32",
                    "S": "i32",
                    "narrow": "i32",
                    "narrow_blocks": "i32",
                    "span_node_ptr": idx,
                    "span_left_ptr": idx,
                    "span_right_ptr": idx,
                    "span_lo_ptr": idx,
                    "span_hi_ptr": idx,
                },
                {
                    "REDUCTION": tb._CODES[reduction],
                    "SB": tb.SPAN_BLOCK,
                    "TB": tb.SPAN_TILES,
                    "WIDE_TB": tb.SPAN_WIDE_TILES,
                },
                4,
            )
        )
    for x in CAPTURE_DTYPES:
        out.append(
            (
                f"_log_softmax_rows {x}",
                capture._log_softmax_rows,
                {
                    "x_ptr": f"*{x}",
                    "x_stride": "i64",
                    "src_ptr": "*i64",
                    "dst_ptr": "*i64",
                    "out_ptr": "*fp32",
                    "out_stride": "i64",
                    "V": "i32",
                },
                {"BLOCK": log_softmax.TRITON_BLOCK},
                4,
            )
        )
    return out


def compile_sm90(kernel, args, constexprs, warps):
    """One configuration of ``_configs()`` compiled for sm_90 (pointers 16-byte aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {a: ("constexpr" if a in constexprs else args[a]) for a in kernel.arg_names}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(kernel.arg_names)
        if signature[a].startswith("*")
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def compile_all():
    """Compile every configuration for sm_90; one dict of resource usage per kernel."""
    import triton

    cuobjdump = os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
    )
    report = []
    for name, kernel, args, constexprs, warps in _configs():
        compiled = compile_sm90(kernel, args, constexprs, warps)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run(
                [cuobjdump, "--dump-resource-usage", f.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        report.append(
            {
                "kernel": name,
                "num_warps": warps,
                "registers": _usage(usage, "REG"),
                "stack": _usage(usage, "STACK"),
                "shared": compiled.metadata.shared,
            }
        )
    return report


def _usage(dump, key):
    """One figure (``REG``, ``STACK``, ...) of ``cuobjdump --dump-resource-usage``."""
    return int(re.search(rf"\b{key}:(\d+)", dump).group(1))


def _table(report):
    return "\n".join(
        f"{r['kernel']:36s} warps {r['num_warps']}  regs {r['registers']:3d}  "
        f"stack {r['stack']:3d} B  shared {r['shared']:6d} B"
        for r in report
    )


def _run_in_subprocess():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default; no warning
    proc = subprocess.run(
        [sys.executable, __file__, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _toolchain_missing():
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        return "triton is not installed"
    nvidia = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(nvidia, "cuobjdump")):
        return "this triton has no bundled NVIDIA toolchain (ptxas/cuobjdump)"
    return None


@pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))
def test_kernels_compile_for_sm90():
    report = _run_in_subprocess()
    assert len(report) == len(_configs())
    table = _table(report)
    for r in report:
        assert r["stack"] <= MAX_STACK, f"{r['kernel']} spills:\n{table}"
        assert r["shared"] <= SM90_SHARED_LIMIT, f"{r['kernel']} shared memory:\n{table}"


if __name__ == "__main__":
    report = compile_all()
    print(json.dumps(report) if "--json" in sys.argv else _table(report))
