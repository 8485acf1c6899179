"""genlm_fast.models.llama3: the Llama-3 tokenizer rebuilt from quicktok's data, and the seeded
Llama-3-architecture checkpoints.

The tokenizer's ids are compared with quicktok's own rank-based BPE encoder (an independent
implementation of the Llama-3 encoding) on varied text. The checkpoint tests build a narrow
model of the same recipe (the real 128,256-token vocabulary, 2 layers) and check it as
transformers reads it; the slow test builds the real 1B architecture and checks that its
next-token distributions are peaked, as a trained model's are.
"""

from __future__ import annotations

import glob
import json
import math
import os
import random

import pytest
import quicktok
import torch

from genlm_fast.models import llama3
from tests.backend.forward64 import LONG_PROMPT

TINY = llama3.Architecture(
    layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, tied=True, rope_factor=32.0
)


@pytest.fixture(scope="module")
def tokenizer():
    return llama3.llama3_tokenizer()


@pytest.fixture(scope="module")
def reference():
    return quicktok.get_encoding("llama3")


def varied_texts():
    rng = random.Random(0)
    alphabet = (
        "abcdefghijklmnopqrstuvwxyzABCXYZ    \n\n\t\r0123456789.,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`|"
        "éüßñçøåΩπ中文日本語한국어😀🎉€£¥•–—…\u00a0\u200b"
    )
    texts = [
        "",
        " ",
        "a",
        "Hello world! It's 2024,  tabs\tand\n\nnewlines 12345 ünïcode 日本語",
        "I'LL WE'VE they'D you're it's",
        "def f(x):\n    return x**2  # comment\n\n\n",
        "   leading and trailing spaces   ",
        "1234567890 3.14159 -42 1,000,000",
        "😀🎉 emoji ‼️ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and \x00\x01 controls",
        " " * 300 + "x",
        "\n" * 50,
    ]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120))) for _ in range(600)]
    here = os.path.dirname(llama3.__file__)
    for file in sorted(glob.glob(os.path.join(here, "*.py"))):  # real code and prose
        with open(file, encoding="utf-8") as f:
            texts.append(f.read())
    return texts


def test_ids_equal_the_reference_bpe(tokenizer, reference):
    for text in varied_texts():
        want = reference.encode(text, allowed_special="all")
        got = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert got == want, repr(text[:80])
        assert tokenizer.decode(got) == text


def test_special_tokens_and_bos(tokenizer, reference):
    assert len(tokenizer) == llama3.VOCAB == reference.n_vocab
    assert tokenizer("Hi there")["input_ids"] == [llama3.BOS, *reference.encode("Hi there")]
    for i in (128000, 128001, 128009, 128255):
        text = reference.decode_single_token_bytes(i).decode()
        assert tokenizer.convert_tokens_to_ids(text) == i
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == [i]
    assert tokenizer.bos_token_id == llama3.BOS and tokenizer.eos_token_id == llama3.EOS


def test_every_token_decodes_to_its_bytes(tokenizer, reference):
    """The vocabulary genlm decodes byte by byte: each BPE token's bytes, through the
    byte-level alphabet, are the reference's."""
    chars = llama3._byte_chars()
    assert len(set(chars)) == 256
    byte_of = {c: b for b, c in enumerate(chars)}
    vocab = tokenizer.get_vocab()
    assert len(vocab) == llama3.VOCAB
    for piece, i in vocab.items():
        if i < llama3.BPE_TOKENS:
            assert bytes(byte_of[c] for c in piece) == reference.decode_single_token_bytes(i)


def test_architecture_parameter_counts():
    """The published sizes: Llama-3.2-1B has 1.24 B parameters, Llama-3.1-8B 8.03 B."""
    assert round(llama3.ARCHITECTURES["llama3.2-1b"].parameters / 1e9, 2) == 1.24
    assert round(llama3.ARCHITECTURES["llama3.1-8b"].parameters / 1e9, 2) == 8.03


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3")
    arch = {**llama3.ARCHITECTURES, "tiny": TINY}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama3, "ARCHITECTURES", arch)
        mp.setattr(llama3, "_SHARD_BYTES", 6 << 20)  # several shards and their index
        path = llama3.llama3_path("tiny", cache_dir=str(root / "tiny"), quiet=True)
    return path


def test_tiny_checkpoint_loads_in_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = sorted(os.listdir(tiny_dir))
    assert "model.safetensors.index.json" in names
    assert sum(n.endswith(".safetensors") for n in names) > 1
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype="auto")
    assert model.dtype == torch.bfloat16
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (128256, 64, 2)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    with open(os.path.join(tiny_dir, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    # every tensor is the seeded one, named as transformers names it
    for name, param in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        want = llama3._tensor(name, tuple(param.shape), 0, torch.bfloat16)
        assert torch.equal(param, want), name
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "The tokenizer saved beside the model"
    assert tok(text)["input_ids"] == llama3.llama3_tokenizer()(text)["input_ids"]


def test_tiny_checkpoint_is_cached_and_rebuilt_for_another_recipe(tiny_dir, monkeypatch):
    monkeypatch.setattr(llama3, "ARCHITECTURES", {**llama3.ARCHITECTURES, "tiny": TINY})
    before = os.stat(os.path.join(tiny_dir, "config.json")).st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a finished checkpoint")

    with monkeypatch.context() as mp:
        mp.setattr(llama3, "_write_weights", no_build)
        assert llama3.llama3_path("tiny", cache_dir=tiny_dir, quiet=True) == tiny_dir
    assert os.stat(os.path.join(tiny_dir, "config.json")).st_mtime_ns == before
    other = os.path.join(os.path.dirname(tiny_dir), "other")
    path = llama3.llama3_path("tiny", seed=1, dtype="float32", cache_dir=other, quiet=True)
    from safetensors import safe_open

    first = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]
    with safe_open(os.path.join(path, first), "pt") as f:
        name = "model.embed_tokens.weight"
        assert f.get_tensor(name).dtype == torch.float32
        assert not torch.equal(
            f.get_tensor(name), llama3._tensor(name, (128256, 64), 0, torch.float32)
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (("llama3-70b",), "unknown architecture"),
        (("llama3.2-1b", "int8"), "dtype"),
        (("llama3.2-1b", "bfloat16", -1), "seed"),
    ],
)
def test_bad_arguments(args, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        llama3.llama3_path(*args, cache_dir=str(tmp_path / "x"))


def test_command_line_runs_without_warnings():
    """``python -m genlm_fast.models``: its own usage, and no runpy warning about a module
    imported twice (warnings are errors in the child)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-W", "error", "-m", "genlm_fast.models", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m genlm_fast.models") and not out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "genlm_fast.models", "llama3-70b"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "invalid choice: 'llama3-70b'" in bad.stderr


@pytest.mark.slow
def test_1b_distributions_are_peaked_and_depend_on_the_context(tmp_path_factory):
    """The real 1B architecture (built once into genlm_fast's cache): a trained model's
    next-token distributions have a few nats of entropy and a head that moves with the
    context; near-uniform ones (11.8 nats) would hide what a peaked row costs."""
    from transformers import AutoModelForCausalLM

    path = llama3.llama3_path("llama3.2-1b", quiet=True)
    tok = llama3.llama3_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [
        "The quick brown fox",
        "def main():\n    return",
        "In 1969, the first",
        "Once upon a time there was",
        "import numpy as np\nx = np.",
        "Paris is the capital of",
    ]
    entropies, tops = [], set()
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tok(prompt)["input_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, -1].double(), -1)
            entropies.append(float(-(logp.exp() * logp).sum()))
            tops.add(int(logp.argmax()))
    mean = sum(entropies) / len(entropies)
    assert 0.5 < mean < 0.6 * math.log(llama3.VOCAB), entropies
    assert len(tops) >= 3, tops


@pytest.mark.slow
@pytest.mark.asyncio
async def test_1b_bfloat16_long_prompt_and_steps_are_float64_of_its_weights():
    """The 1B architecture in bfloat16, as a hub checkpoint loads: a prompt longer than the
    fused forward takes and the steps after it, through AsyncTransformer, are within 1e-3
    of a float64 forward of the very same bfloat16 weights (one float64 forward of the
    whole context gives every prefix's answer)."""
    from transformers import AutoModelForCausalLM

    from genlm_fast.backend.llm import AsyncTransformer

    path = llama3.llama3_path("llama3.2-1b", quiet=True)
    tok = llama3.llama3_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompt = tok(LONG_PROMPT)["input_ids"]
    assert len(prompt) > 100
    lm = AsyncTransformer(model, tok)
    try:
        ctx = list(prompt)
        rows = [await lm.next_token_logprobs(ctx)]
        for _ in range(2):
            ctx.append(int(rows[-1].argmax()))
            rows.append(await lm.next_token_logprobs(ctx))
    finally:
        lm.cleanup()
    oracle = model.double()  # in place: the bfloat16 weights, widened exactly
    with torch.no_grad():
        want = torch.log_softmax(oracle(torch.tensor([ctx])).logits[0].double(), -1)
    for i, row in enumerate(rows):
        assert (row.double() - want[len(prompt) - 1 + i]).abs().max() < 1e-3


_MEMORY_CHILD = r"""
import json, sys
import transformers
from genlm_fast.backend.llm import AsyncTransformer

path, prompt = sys.argv[1], sys.argv[2]
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))
# what loading imports (transformers' model and tokenizer code) belongs to the runtime
config = transformers.AutoConfig.from_pretrained(path)
transformers.AutoModelForCausalLM._model_mapping[type(config)]
transformers.PreTrainedTokenizerFast
runtime = status("VmRSS")
lm = AsyncTransformer.from_name(path)
loaded = status("VmRSS")
ids = lm.tokenizer.encode(prompt)
lm.next_token_logprobs_sync(ids)  # longer than a fused forward: transformers' forward
rows = [ids + [100 + i] for i in range(16)]
for step in range(3):
    lm.batch_next_token_logprobs_sync(rows)
    rows = [r + [7 + step] for r in rows]
params = {p.data_ptr(): p for p in lm.model.parameters()}.values()
print(json.dumps({
    "path": lm.forward_path,
    "weights": sum(p.numel() * p.element_size() for p in params),
    "runtime": runtime,
    "loaded": loaded,
    "after": status("VmRSS"),
    "peak": status("VmHWM"),
    "positions": len(ids) + 16 * 3,
    "rows": 1 + 16 * 3,
}))
"""


@pytest.mark.slow
def test_1b_bfloat16_is_resident_once():
    """Loaded as a hub checkpoint loads (``dtype="auto"``: bfloat16, mapped from the file),
    the 1B model holds at most 1.15x its weights beyond the runtime after loading and after
    a long prompt (transformers' forward) and 16-row decoding steps, plus what those steps
    cache (keys and values, log-probability rows); at most 1.3x at its peak. Where the fused
    decoder runs, its packed copy is the one resident copy; elsewhere the weights are."""
    import subprocess
    import sys

    path = llama3.llama3_path("llama3.2-1b", quiet=True)
    child = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD, path, LONG_PROMPT],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert child.returncode == 0, child.stderr[-3000:]
    r = json.loads(child.stdout.strip().splitlines()[-1])
    arch = llama3.ARCHITECTURES["llama3.2-1b"]
    position = arch.layers * 2 * arch.kv_heads * (arch.hidden // arch.heads) * 4  # float32
    caches = r["positions"] * position + r["rows"] * llama3.VOCAB * 4
    w = r["weights"]
    assert r["loaded"] - r["runtime"] <= 1.15 * w, r
    assert r["after"] - r["runtime"] <= 1.15 * w + caches, r
    assert r["peak"] - r["runtime"] <= 1.3 * w, r
