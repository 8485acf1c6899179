"""Where the CUDA toolkit's headers are, for the tests that compile CUDA sources without a
GPU (the emulator, the bindings' compile check): a CPU torch's ``cpp_extension.CUDA_HOME``
is None, so nvcc itself is asked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess


def cuda_include_dirs() -> list[str] | None:
    """The include directories nvcc passes to its host compiler that hold ``cuda_fp16.h``
    (read from ``nvcc --dryrun``), or None without nvcc or without them."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    dry = subprocess.run(
        [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    dirs = re.findall(
        r'-I"?([^"\s]+)',
        "".join(line for line in dry.stderr.splitlines() if line.startswith("#$ INCLUDES=")),
    )
    return [d for d in dirs if os.path.exists(os.path.join(d, "cuda_fp16.h"))] or None
