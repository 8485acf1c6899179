"""Static cost of the GPU kernels' loops, without a GPU: compile for sm_90 and count SASS.

    python -m tools.gpu.sass_loops                 # the tile kernels, Triton and CUDA
    python -m tools.gpu.sass_loops --sass DIR      # also keep each kernel's SASS in DIR

Compiles the Triton tile kernels through Triton's own pipeline (as
``tests/ops/test_triton_sm90.py`` does) and ``csrc/trie_reduce_cuda.cu`` with nvcc
(``-arch=sm_90 -cubin``), disassembles them with the ``nvdisasm`` Triton bundles, and prints,
for every loop (a branch back to an earlier label), the number of instructions in its body per
thread. With the number of node values one trip of the loop produces per thread, that is the
issue cost per value: a lower bound on the time (an H100 SM issues 4 warp-instructions per
cycle), not a timing. Loops are listed in program order with their first source line.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TRITON_KERNELS = (
    "_tile_ranges_dot log_mass/fp32",
    "_tile_ranges_dot sum/fp32",
    "_tile_ranges_max max/fp32",
)
# tile_kernel<T, RED, ROWS> instances (mangled-name fragments): float log_mass, sum, max
CUDA_KERNELS = {
    "tile_kernel<float, log_mass, 32>": "tile_kernelIfLi2ELi32E",
    "tile_kernel<float, sum, 32>": "tile_kernelIfLi0ELi32E",
    "tile_kernel<float, max, 32>": "tile_kernelIfLi1ELi32E",
}
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")
_LINE = re.compile(r'//## File ".*?", line (\d+)')


def _toolchain():
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def loops(sass: str) -> list[tuple[int, int]]:
    """(instructions in the body, source line of its first instruction or 0) of every loop
    of one function."""
    labels, line_of, found = {}, [], []
    last_line = 0
    for text in sass.splitlines():
        if m := _LINE.search(text):
            last_line = int(m.group(1))
        if m := _LABEL.match(text):
            labels[m.group(1)] = len(line_of)
        elif m := _INSTR.match(text):
            line_of.append(last_line)
            b = _BRANCH.search(m.group(2))
            if b and b.group(1) in labels and "BRA.DIV" not in m.group(2):
                first = labels[b.group(1)]
                found.append((len(line_of) - first, line_of[first]))
    return found


def _function(sass: str, fragment: str) -> str:
    """The disassembly of the one function whose section name holds ``fragment``."""
    out, inside = [], False
    for text in sass.splitlines():
        if text.startswith(".text."):
            inside = fragment in text
        if inside:
            out.append(text)
    return "\n".join(out)


def triton_sass(name: str) -> str:
    sys.path.insert(0, str(REPO / "tests" / "ops"))
    import test_triton_sm90

    for label, kernel, args, constexprs, warps in test_triton_sm90._configs():
        if label != name:
            continue
        compiled = test_triton_sm90.compile_sm90(kernel, args, constexprs, warps)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            return subprocess.run(
                [str(_toolchain() / "nvdisasm"), "-c", "-g", f.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
    raise KeyError(name)


def cuda_sass() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run(
            [
                nvcc,
                "-std=c++17",
                "-O3",
                "-lineinfo",
                "-arch=sm_90",
                "-cubin",
                str(REPO / "csrc" / "trie_reduce_cuda.cu"),
                "-o",
                cubin,
            ],
            check=True,
        )
        return subprocess.run(
            [str(_toolchain() / "nvdisasm"), "-c", "-g", cubin],
            capture_output=True,
            text=True,
            check=True,
        ).stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", help="folder to keep each kernel's disassembly in")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    kernels = {name: triton_sass(name) for name in TRITON_KERNELS}
    all_cuda = cuda_sass()
    kernels.update({name: _function(all_cuda, frag) for name, frag in CUDA_KERNELS.items()})
    for name, sass in kernels.items():
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            Path(args.sass, re.sub(r"\W+", "_", name).strip("_") + ".sass").write_text(sass)
        body = ", ".join(f"{n} (line {line})" if line else str(n) for n, line in loops(sass))
        print(f"{name}: loop bodies, instructions per thread: {body or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
