"""Loading a model and its tokenizer for `AsyncTransformer.from_name`: from a local
directory, the Hugging Face Hub or its cache, with errors that say which was missing."""

from __future__ import annotations

import importlib.util
import os

__all__ = ["is_missing_path", "load"]


def load(model_id, bitsandbytes_opts=None, hf_opts=None):
    """``(model, tokenizer)`` of ``model_id`` (`AsyncTransformer.from_name`'s arguments).

    Raises:
        FileNotFoundError: The model could not be found (not a directory, and not
            available from the Hub or its local cache), or its directory has no tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genlm_fast.models import resolve_model_name

    model_id = resolve_model_name(model_id)
    opts = {"device_map": "auto", "dtype": "auto"}
    if hf_opts:
        if "torch_dtype" in hf_opts:
            opts.pop("dtype")
        opts.update(hf_opts)
    if opts.get("device_map") == "auto" and importlib.util.find_spec("accelerate") is None:
        opts.pop("device_map")
    if bitsandbytes_opts:
        from transformers import BitsAndBytesConfig

        opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)

    if isinstance(model_id, str) and is_missing_path(model_id):
        raise FileNotFoundError(f"model directory {model_id!r} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError) as exc:
        if isinstance(model_id, str) and os.path.isdir(model_id):
            if not any(os.path.exists(os.path.join(model_id, name)) for name in _TOKENIZER_FILES):
                raise FileNotFoundError(
                    f"model directory {model_id!r} has no tokenizer (none of "
                    f"{', '.join(_TOKENIZER_FILES)}): save the tokenizer beside the "
                    "model, e.g. tokenizer.save_pretrained(path)"
                ) from exc
            raise  # found, but unreadable: transformers' own message says why
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
        where = " (HF_HUB_OFFLINE is set, so only local files are used)" if offline else ""
        raise FileNotFoundError(
            f"could not load model {model_id!r}: it is not a local model directory and "
            f"was not found on the Hugging Face Hub or in its cache{where}"
        ) from exc
    model = AutoModelForCausalLM.from_pretrained(model_id, **opts)
    return model, tokenizer


# the files a saved tokenizer consists of, one at least (fast, slow BPE, SentencePiece,
# WordPiece, tiktoken)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "vocab.txt",
    "tokenizer.tiktoken",
)


def is_missing_path(model_id):
    """True for an id that can only be meant as a local path, and does not exist."""
    if os.path.exists(model_id):
        return False
    expanded = os.path.expanduser(model_id)
    return (
        os.path.isabs(expanded)
        or model_id.startswith(("./", "../", "~"))
        or model_id.count("/") > 1
    )
