"""Loader of the compiled trie kernels (``csrc/``), which ``cpu_backend`` and ``cuda_backend``
run.

``genlm_fast._C`` is built by ``pip install -e .`` (a ``CppExtension``, or a
``CUDAExtension`` when torch has CUDA and nvcc is found). When it was not built, the CPU
kernels are JIT-compiled on first use with ``torch.utils.cpp_extension.load`` into
``~/.cache/genlm_fast/ext`` (``$GENLM_FAST_CACHE/ext`` when set; ``GENLM_FAST_NO_JIT=1``
disables this). A failure is remembered and reported by :func:`why_missing`; the
dispatcher then falls back to another backend. Importing this module never raises.

The JIT cache: one folder per Python ABI, machine and torch version
(``<cache>/ext/cpython-311-x86_64-linux-gnu-torch2.13.0_cpu``); inside it torch's ninja build
rebuilds whatever changed (sources, headers, flags). Builds into one folder are serialized
by an ``flock`` on ``genlm_fast.lock`` (released by the kernel when a build is killed, so it
never goes stale; a process waiting for it loads the finished module). A failed build
leaves ``failed.txt`` with the error and a fingerprint of what was tried (sources, flags,
compiler, ninja, torch): later processes skip the same doomed build (no minute-long retry
in every new process) until any of that changes or the file is deleted.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
from contextlib import contextmanager

import genlm_fast
from genlm_fast.ops import sources as csrc

logger = logging.getLogger("genlm_fast.ops")

_lock = threading.Lock()
_module = None  # the loaded extension module
_origin = None  # "prebuilt" or the JIT build directory
_error = None  # why loading failed (a string), once tried
_stale = ""  # why the prebuilt module may not be what csrc/ builds now ("" if it is)
_tried = False


def cache_dir() -> str:
    """Where JIT builds go: ``<genlm_fast cache root>/ext`` (`genlm_fast.cache_dir`)."""
    return genlm_fast.cache_dir("ext")


def _fingerprint(cflags, compiler: str | None) -> str:
    """What a JIT build depends on: the csrc files' contents, the flags, the compiler and
    ninja (path and modification time: an upgrade or a newly installed one changes it),
    torch. Two builds with one fingerprint succeed or fail alike."""
    import torch

    digest = hashlib.sha256((csrc.digest() or "").encode())
    tools = []
    for tool in (compiler, shutil.which("ninja")):
        try:
            tools.append(f"{tool}@{os.path.getmtime(tool) if tool else ''}")
        except OSError:
            tools.append(str(tool))
    digest.update(
        repr(
            (
                cflags,
                tools,
                torch.__version__,
                os.environ.get("CXX"),
                os.environ.get("LDFLAGS"),
                os.environ.get("CPATH"),
            )
        ).encode()
    )
    return digest.hexdigest()


def build_tag(variant: str = "") -> str:
    """The JIT build folder's name: Python ABI and machine (``SOABI``), torch version."""
    import torch

    abi = sysconfig.get_config_var("SOABI") or "py{}{}".format(*sys.version_info[:2])
    return "{}-torch{}{}".format(abi, torch.__version__.replace("+", "_"), variant)


class _BuildLock:
    """An exclusive ``flock`` on ``<build_dir>/genlm_fast.lock`` around a JIT build: one
    build per folder at a time across processes, released by the kernel however the holder
    ends (so it never goes stale). torch's own ``lock`` file has no timeout: under the flock
    one can only be a killed build's leftover, and is removed."""

    def __init__(self, build_dir: str):
        self.build_dir = build_dir
        self.fd = None

    def __enter__(self):
        self.fd = os.open(
            os.path.join(self.build_dir, "genlm_fast.lock"), os.O_RDWR | os.O_CREAT, 0o666
        )
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning(
                "genlm_fast: waiting for another process building the CPU kernels into %s",
                self.build_dir,
            )
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        leftover = os.path.join(self.build_dir, "lock")
        if os.path.exists(leftover):
            logger.warning("genlm_fast: removing %s, left by an interrupted build", leftover)
            _remove(leftover)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the flock
        self.fd = None
        return False


# build failures not to remember: the next attempt may well succeed
_TRANSIENT = (
    "Killed",
    "internal compiler error",
    "No space left",
    "Interrupted",
    "Resource temporarily unavailable",
    "Cannot allocate memory",
)


def _read(path: str) -> tuple[str | None, str]:
    """A marker file's first line and the rest; (None, "") when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            first, _, rest = f.read().partition("\n")
        return first.strip(), rest.strip()
    except OSError:
        return None, ""


def _write(path: str, text: str) -> None:
    try:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _import_library(name: str, path: str):
    import importlib.util

    import torch  # noqa: F401  (libtorch first)

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summarize_error(exc: BaseException) -> str:
    """One line for a failed build: the compiler's or linker's first error line (torch's
    message starts with "Error building extension" and ends with ninja's "build stopped"),
    else the message's last line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    for wanted in ("error:", "cannot find", "undefined reference", "error"):
        found = [
            line
            for line in lines
            if wanted in line.lower()
            and not line.startswith(
                ("Error building extension", "ninja:", "FAILED:", "[", "c++ ", "g++ ")
            )
        ]
        if found:
            text = found[0]
            break
    return f"{type(exc).__name__}: {text[:500]}"


def _jit_build(defines=()):
    """Compile the CPU kernels into the cache; ``defines`` (macro names) give a variant its
    own module name and directory (tests build -DGF_BASELINE_ONLY -DGF_TRIE_ONLY this way:
    GF_TRIE_ONLY compiles the trie op's sources alone, `sources.TRIE_CPU_SOURCES`)."""
    from torch.utils import cpp_extension

    names = csrc.TRIE_CPU_SOURCES if "GF_TRIE_ONLY" in defines else csrc.CPU_SOURCES
    sources = [os.path.join(csrc.CSRC, name) for name in names]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise RuntimeError(
            f"the C++ sources are not available for a JIT build ({missing[0]} "
            "is missing); reinstall from a source checkout with `pip install -e .`"
        )
    compiler = csrc.configured_compiler()
    if compiler is None:
        raise RuntimeError(
            "no C++ compiler found ({} is not on PATH)".format(
                f"CXX={os.environ['CXX']}" if os.environ.get("CXX") else "c++"
            )
        )
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (`pip install ninja`)")
    variant = "".join(f"-{d}" for d in defines)
    name = "genlm_fast_C" + variant.replace("-", "_").lower()
    cflags = [*csrc.CXX_FLAGS, *(f"-D{d}" for d in defines)]
    build_dir = os.path.join(cache_dir(), build_tag(variant))
    fingerprint = _fingerprint(cflags, compiler)
    built = os.path.join(build_dir, "built.txt")  # the fingerprint of the module there
    failed = os.path.join(build_dir, "failed.txt")  # fingerprint and error of a failure
    library = os.path.join(build_dir, name + ".so")
    if (
        os.path.isdir(build_dir)
        and not os.access(build_dir, os.W_OK)
        and _read(built)[0] == fingerprint
        and os.path.exists(library)
    ):
        # a read-only cache holding the module these sources build: load it as it is
        return _import_library(name, library), build_dir
    os.makedirs(build_dir, exist_ok=True)
    with _BuildLock(build_dir):
        seen, error = _read(failed)
        if seen == fingerprint:
            raise RuntimeError(
                f"{error} (remembered from an earlier attempt with the same "
                f"sources, flags and compiler; delete {failed} to retry)"
            )
        fresh = _read(built)[0] == fingerprint and os.path.exists(library)
        if fresh:
            logger.debug("genlm_fast: loading the CPU trie kernels from %s", build_dir)
        else:
            logger.warning(
                "genlm_fast: compiling the CPU trie kernels into %s (once; a minute or more)",
                build_dir,
            )
        try:
            _remove(built)
            # a compiler that would copy a static libstdc++ into the module: one in /usr/bin
            # instead, when there is one (cpp_extension.load runs $CXX; the choice follows
            # from the configured compiler, which the fingerprint holds)
            cxx, _, note = (compiler, None, None) if fresh else csrc.choose_compilers(compiler)
            if note:
                logger.warning("genlm_fast: %s", note)
            with _environ_set("CXX", cxx if cxx != compiler else None):
                module = cpp_extension.load(
                    name=name,
                    sources=sources,
                    extra_cflags=cflags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=build_dir,
                    verbose=False,
                )
        except Exception as exc:
            summary = summarize_error(exc)
            if not any(t in summary for t in _TRANSIENT):
                _write(failed, f"{fingerprint}\n{summary}")
            raise
        _remove(failed)
        _write(built, fingerprint)
    return module, build_dir


@contextmanager
def _environ_set(name: str, value: str | None):
    """``os.environ[name] = value`` for the block (nothing when value is None), then the
    variable as it was: present with its old value, or absent."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def load_module():
    """The extension module, building it (CPU only) on first use; None if unavailable."""
    global _module, _origin, _error, _tried, _stale
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        reasons = []
        try:
            import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

            from genlm_fast import _C  # built by `pip install -e .`

            _module, _origin = _C, "prebuilt"
            _stale = _stale_reason(_C)
            if _stale:
                logger.warning("genlm_fast: %s", _stale)
        except Exception as exc:  # noqa: BLE001
            # ImportError, or an ABI mismatch after a torch upgrade
            reasons.append(f"genlm_fast._C is not built ({type(exc).__name__}: {exc})")
        if _module is None:
            if os.environ.get("GENLM_FAST_NO_JIT") == "1":
                reasons.append("JIT compilation is disabled (GENLM_FAST_NO_JIT=1)")
            else:
                try:
                    _module, _origin = _jit_build()
                except Exception as exc:  # noqa: BLE001
                    # no compiler, no ninja, read-only cache, ...
                    reasons.append(f"JIT compilation failed ({summarize_error(exc)})")
        if _module is None:
            _error = "; ".join(reasons) + (
                ". Install a C++ compiler (g++ with OpenMP) and run `pip install -e . "
                "--no-build-isolation` to get the fast CPU path."
            )
            logger.info("genlm_fast: compiled trie kernels unavailable: %s", _error)
        _tried = True
        return _module


def _stale_reason(module) -> str:
    """Compare the digest setup.py stamped next to the prebuilt module (``_C.sources``)
    with the sources in csrc/ now: an editable install keeps loading its old build after
    csrc/ is edited. "" when they match or cannot be compared (no stamp, no csrc/)."""
    stamp, _ = _read(os.path.join(os.path.dirname(module.__file__), "_C.sources"))
    now = csrc.digest()
    if not stamp or now is None or stamp == now:
        return ""
    return (
        f"genlm_fast._C was built from other sources than those in {csrc.CSRC} now; "
        "rebuild it with `pip install -e . --no-build-isolation`"
    )


def stale_reason() -> str:
    """Why the loaded prebuilt module is older than csrc/ ("" when it is not, or unknown)."""
    load_module()
    return _stale


def origin() -> str | None:
    """``"prebuilt"`` (genlm_fast._C), the JIT build directory, or None if not loaded."""
    load_module()
    return _origin


def _cuda_runtime_ok() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def has(kind: str) -> bool:
    """Whether the compiled ``kind`` ("cpu" or "cuda") backend can run in this process."""
    try:
        if kind not in ("cpu", "cuda"):
            return False
        if kind == "cuda" and not _cuda_runtime_ok():
            return False
        module = load_module()
        if module is None:
            return False
        return hasattr(module, "trie_reduce_" + kind)
    except Exception:  # noqa: BLE001  never let a probe break the dispatcher
        return False


def why_missing(kind: str) -> str:
    """A human-readable reason why :func:`has` is False for ``kind`` ("" when it is True)."""
    if has(kind):
        return ""
    if kind not in ("cpu", "cuda"):
        return f"unknown compiled backend {kind!r} (expected 'cpu' or 'cuda')"
    if kind == "cuda" and not _cuda_runtime_ok():
        return "no CUDA device is available to torch (torch.cuda.is_available() is False)"
    module = load_module()
    if module is None:
        return _error or "the extension could not be loaded"
    return (
        "genlm_fast._C was built without CUDA kernels (the installing torch had no CUDA "
        "or nvcc was not found); reinstall with a CUDA build of torch and CUDA_HOME set: "
        "`pip install -e . --no-build-isolation`"
    )
