"""tools.gpu.sass_loops: loop bodies found in SASS, and the real kernels compile into it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tools.gpu import sass_loops

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SASS = """\
.text.kern_a:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        //## File "k.cu", line 7
        /*0010*/                   LDS R2, [R3] ;
.L_x_1:
        /*0020*/                   STG.E desc[UR4][R4.64], R2 ;
        /*0030*/              @P0 BRA `(.L_x_1) ;
        /*0040*/                   BRA.DIV UR6, `(.L_x_0) ;
        /*0050*/              @!P1 BRA `(.L_x_0) ;
        /*0060*/              @P2 BRA `(.L_x_2) ;
.L_x_2:
        /*0070*/                   EXIT ;
.text.kern_b:
        /*0000*/                   EXIT ;
"""


def test_loops_are_backward_branches_with_their_bodies():
    # the inner loop: STG + BRA; the outer: LDS, the inner loop, BRA.DIV, BRA; a forward
    # branch and a divergence branch are not loops
    assert sass_loops.loops(SASS) == [(2, 7), (5, 7)]


def test_function_picks_one_section():
    assert "LDS" in sass_loops._function(SASS, "kern_a")
    assert sass_loops._function(SASS, "kern_b").count("EXIT") == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_every_tile_kernel_is_found_and_has_loops():
    pytest.importorskip("triton.backends.compiler")
    # a subprocess: under TRITON_INTERPRET (the test session's, without a GPU) @triton.jit
    # makes interpreter objects, which do not compile
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "tools.gpu.sass_loops"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    names = list(sass_loops.TRITON_KERNELS) + list(sass_loops.CUDA_KERNELS)
    assert [line.split(":")[0] for line in lines] == names
    assert all("none" not in line for line in lines)
