"""A model directory in genlm_fast's cache, built once, atomically, and checked on every use.

`prepare` is the one way the local checkpoints of `genlm_fast.models` reach the disk: the
model is built into a temporary sibling directory and renamed into place, so an interrupted
build never leaves a half-written model behind and concurrent builders agree on one copy;
what a killed build left next to it is removed by the next build. A finished directory
carries a marker naming its recipe (a small dict); a directory whose marker names another
recipe, or whose files are damaged (weights truncated or deleted, a config overwritten), is
built again instead of being handed to transformers. An existing directory that is not one
of ours is never overwritten: that is a `FileExistsError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time

_MARKER = "genlm_fast_model.json"
_OWNER = ".genlm_fast_owner"
_STALE_S = 3600.0  # a work directory with no live owner, untouched this long, is a leftover


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


def is_ready(path: str, recipe: dict) -> bool:
    """A finished build of ``recipe``: the marker (naming that recipe), a readable config and
    tokenizer, and whole weights.

    Checked on every call (a few KB read), so that a cache damaged after the fact (a weights
    file truncated or deleted, a config overwritten) is built again instead of being
    handed to transformers, which would fail on it with a low-level error.
    """
    info = _read_marker(path)
    if info is None or any(info.get(key) != value for key, value in recipe.items()):
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


def _owner_alive(work: str) -> bool | None:
    """Whether the process building into ``work`` still runs: True/False, or None when
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


def _remove_stale_work(parent: str, prefix: str) -> None:
    """Remove what killed builds left next to the model directory (temporary directories
    named ``prefix...``, as large as the model): those whose process is gone, or, where
    that cannot be told, that nobody has written to for an hour."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    now = time.time()
    for name in names:
        work = os.path.join(parent, name)
        if not name.startswith(prefix) or not os.path.isdir(work) or os.path.islink(work):
            continue
        alive = _owner_alive(work)
        if alive is None:
            try:
                alive = now - os.stat(work).st_mtime < _STALE_S
            except OSError:
                continue
        if not alive:
            shutil.rmtree(work, ignore_errors=True)


def _check_target(path: str, name: str) -> None:
    """Refuse to replace anything at ``path`` that is not an (unfinished) copy of ours."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise FileExistsError(
            f"{path!r} exists and is not a directory; cannot put the {name} model there"
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


def _install(work: str, path: str, recipe: dict, name: str, prefix: str) -> None:
    """Mark ``work`` finished and rename it to ``path`` (atomically; an unfinished copy of
    ours already there is first moved aside, never deleted in place)."""
    with open(os.path.join(work, _MARKER), "w") as f:
        json.dump(recipe, f)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(work, _OWNER))
    _apply_umask(work)
    parent = os.path.dirname(path)
    if os.path.isdir(path) and not is_ready(path, recipe):
        _check_target(path, name)  # ours (or empty): it may go
        trash = tempfile.mkdtemp(prefix=prefix + "old-", dir=parent)
        try:
            os.rename(path, os.path.join(trash, "model"))
        except OSError:
            pass  # gone meanwhile (another process replaced it)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(work, path)
    except OSError:
        if not is_ready(path, recipe):
            raise
        # Another process finished first; its copy is as good as ours.
        shutil.rmtree(work, ignore_errors=True)


def show_progress(quiet: bool | None) -> bool:
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


def prepare(path: str, recipe: dict, build, *, name: str, steps: list[str], quiet=None) -> str:
    """Return ``path`` holding the model of ``recipe``, building it first where needed.

    Args:
        path (str): The model directory (``~`` expanded).
        recipe (dict): What the directory holds (JSON-able); written as its marker.
        build: ``build(work, bar, show)`` writes the model into the empty directory
            ``work``, calling ``bar.set_postfix_str(step)`` / ``bar.update()`` per step;
            ``show`` says whether progress is displayed.
        name (str): The model's name, for messages and work directories.
        steps (list[str]): The build's steps, for the progress bar (a last "finish" is added).
        quiet (bool, optional): ``True``: no progress output. ``False``: a progress bar on
            standard error. ``None``: a bar only when standard error is a terminal.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if is_ready(path, recipe):
        return path
    from tqdm.auto import tqdm

    _check_target(path, name)  # before the slow part: never overwrite someone's directory
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    prefix = "." + os.path.basename(path) + "-"  # work directories: ".<model dir>-..."
    _remove_stale_work(parent, prefix)
    work = tempfile.mkdtemp(prefix=prefix, dir=parent)
    show = show_progress(quiet)
    bar = tqdm(
        total=len(steps) + 1,
        desc=f"Preparing {name} (once)",
        unit="step",
        disable=not show,
        file=sys.stderr,
        leave=True,
    )
    try:
        with open(os.path.join(work, _OWNER), "w") as f:  # lets others tell it is alive
            json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
        build(work, bar, show)
        bar.set_postfix_str("finish")
        _install(work, path, recipe, name, prefix)
        bar.update()
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        bar.close()
    return path
