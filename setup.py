"""Build script: the genlm_fast package (its Triton kernels in ``genlm_fast/kernels/``) and
the optional compiled trie kernels ``genlm_fast._C``.

    pip install torch                       # first: the build uses the installed torch
    pip install -e . --no-build-isolation   # or `pip install . --no-build-isolation`

``genlm_fast._C`` is a CppExtension (C++17/OpenMP CPU kernels); when the installed torch has
CUDA (``torch.version.cuda``) and nvcc is found (CUDA_HOME or PATH), it is a CUDAExtension
that also holds the CUDA kernels (``csrc/trie_reduce_cuda.cu``, compiled with -DWITH_CUDA).
If the extension cannot be built (no compiler, no torch at build time, a CUDA toolchain
mismatch), the install still succeeds without it: a warning is printed and genlm_fast JIT-
compiles the CPU kernels on first use or falls back to its plain-torch reference.

Environment: GENLM_FAST_NO_EXT=1 skips the extension; GENLM_FAST_NO_CUDA=1 builds the CPU
kernels only even with a CUDA torch. $CXX (else c++) compiles it, unless that compiler links
libstdc++ statically: then a /usr/bin g++/c++ that links the shared one, with a warning.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_sources_module():
    """genlm_fast/ops/sources.py, loaded by path (the package is not importable yet): the
    CPU sources and C++ flags the JIT build uses too, and the digest of csrc/."""
    spec = importlib.util.spec_from_file_location(
        "genlm_fast_sources", os.path.join(HERE, "genlm_fast", "ops", "sources.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOURCES = _load_sources_module()
CXX_FLAGS = list(SOURCES.CXX_FLAGS)
NVCC_FLAGS = ["-O3", "-DWITH_CUDA"]


def _warn(message: str) -> None:
    sys.stderr.write(f"\nWARNING (genlm_fast): {message}\n\n")


def _choose_compilers() -> None:
    """$CXX/$CC for the build: the configured C++ compiler, unless it links libstdc++
    statically (genlm_fast/ops/sources.py: choose_compilers) and /usr/bin has one that
    does not."""
    configured = SOURCES.configured_compiler()
    if configured is None:
        return
    cxx, cc, note = SOURCES.choose_compilers(configured)
    if note:
        _warn(note)
    if cxx != configured:
        os.environ["CXX"] = cxx
        if cc is not None:
            os.environ["CC"] = cc


def _extensions():
    """(ext_modules, cmdclass) for the compiled kernels, or ([], {}) when they cannot be built."""
    if os.environ.get("GENLM_FAST_NO_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # noqa: BLE001
        # torch is a runtime dependency, not a build requirement
        _warn(
            f"torch is not importable at build time ({exc}); building without the compiled "
            "kernels. Install torch first and use `pip install --no-build-isolation`."
        )
        return [], {}

    csrc = "csrc"
    sources = [f"{csrc}/{name}" for name in SOURCES.CPU_SOURCES]
    # every header and source (the .cu too, even when building without CUDA): a change to
    # any of them rebuilds, and sdists carry them
    depends = [f"{csrc}/{name}" for name in SOURCES.source_files(os.path.join(HERE, csrc))]
    # torch finds the toolkit from CUDA_HOME / CUDA_PATH or the nvcc on PATH
    use_cuda = (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and os.environ.get("GENLM_FAST_NO_CUDA") != "1"
    )
    ext = None
    if use_cuda:
        try:
            ext = cpp_extension.CUDAExtension(
                "genlm_fast._C",
                sources + [f"{csrc}/{name}" for name in SOURCES.CUDA_SOURCES],
                depends=depends,
                include_dirs=[os.path.join(HERE, csrc)],
                extra_compile_args={"cxx": CXX_FLAGS + ["-DWITH_CUDA"], "nvcc": NVCC_FLAGS},
                extra_link_args=["-fopenmp"],
            )
        except Exception as exc:  # noqa: BLE001
            _warn(f"cannot set up the CUDA kernels ({exc}); building the CPU kernels only.")
    if ext is None:
        ext = cpp_extension.CppExtension(
            "genlm_fast._C",
            sources,
            depends=depends,
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=["-fopenmp"],
        )
    ext.optional = True  # setuptools: skip it (and its in-place copy) when it fails to build

    class OptionalBuildExtension(cpp_extension.BuildExtension):
        """BuildExtension that warns and carries on when the compiled kernels fail to build."""

        def run(self):
            _choose_compilers()
            try:
                super().run()
            except Exception:  # noqa: BLE001
                _warn(
                    "could not build the compiled trie kernels (genlm_fast._C); installing "
                    "without them. genlm_fast will JIT-compile the CPU kernels on first use "
                    "or fall back to the plain-torch reference.\n" + traceback.format_exc(limit=3)
                )

        def build_extension(self, extension):
            try:
                super().build_extension(extension)
                self._stamp()
                return
            except Exception:  # noqa: BLE001
                failure = traceback.format_exc(limit=3)
            cuda_sources = {f"{csrc}/{name}" for name in SOURCES.CUDA_SOURCES}
            if cuda_sources & set(extension.sources):
                # a CUDA toolchain problem (nvcc/host compiler/arch) must not cost the CPU
                # kernels: retry without the CUDA sources and without -DWITH_CUDA
                _warn(
                    "building the CUDA trie kernels failed; retrying with the CPU kernels "
                    "only.\n" + failure
                )
                extension.sources = [s for s in extension.sources if s not in cuda_sources]
                args = extension.extra_compile_args
                if isinstance(args, dict):
                    args["cxx"] = [a for a in args.get("cxx", []) if a != "-DWITH_CUDA"]
                try:
                    super().build_extension(extension)
                    self._stamp()
                    return
                except Exception:  # noqa: BLE001
                    failure = traceback.format_exc(limit=3)
            _warn(f"building {extension.name} failed; installing without it.\n" + failure)

        def _stamp(self):
            """Beside an in-tree (editable) build: the digest of the csrc/ it was built from,
            so that genlm_fast notices when csrc/ changes and the module is not rebuilt."""
            if not (self.inplace or getattr(self, "editable_mode", False)):
                return
            try:
                with open(os.path.join(HERE, "genlm_fast", "_C.sources"), "w") as f:
                    f.write(SOURCES.digest(os.path.join(HERE, "csrc")) + "\n")
            except Exception as exc:  # noqa: BLE001  the module is built: keep it
                _warn(f"could not record the digest of csrc/ ({exc})")

        def get_outputs(self):
            # a skipped extension has no output; editable installs must not look for it
            return [
                p
                for p in super().get_outputs()
                if os.path.exists(p) or not p.endswith((".so", ".pyd", ".dylib"))
            ]

        def get_output_mapping(self):
            return {
                built: inplace
                for built, inplace in super().get_output_mapping().items()
                if os.path.exists(built)
            }

    return [ext], {"build_ext": OptionalBuildExtension.with_options(no_python_abi_suffix=False)}


ext_modules, cmdclass = _extensions()

setup(
    packages=find_packages(include=["genlm_fast", "genlm_fast.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
