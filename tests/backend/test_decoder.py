"""The fused CPU decoder (genlm_fast/backend/llm/decoder.py, csrc/decoder_cpu.cpp) behind
AsyncTransformer, on tiny seeded random models of each family it knows (built from a config,
nothing downloaded): every log-probability against transformers' float64 forward of the same
weights over the whole context (no cache), through decoding rounds over cached pasts of
different lengths, 1 and 2 new tokens, B=1 and B=16; then the bad inputs (contexts past the
position limit, NaN/inf), the fallback for an architecture it does not know, and what cleanup
releases. Weights edited after packing are in test_decoder_weight_edits.py, the real SmolLM2
in test_decoder_smollm2.py.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import random
import weakref

import pytest
import torch

from genlm_fast.backend.llm import AsyncTransformer, NonFiniteLogitsError, decoder_spec
from genlm_fast.backend.llm import decoder as decoder_mod
from tests.backend.fused import needs_fused
from tests.backend.small_models import tokenizer as tokenizer  # a fixture
from tests.backend.tiny_decoders import (
    FAMILIES,
    Oracle,
    V,
    assert_matches,
    rounds,
    spy_fused,
    tiny_config,
    tiny_model,
)


@needs_fused
def test_the_fused_decoder_is_built():
    """On a CPU with AVX-512F the extension has the decoder: a missing, stale or broken build
    fails here (and in every test that needs it) instead of skipping them."""
    assert decoder_mod.fused_available() is None


@needs_fused
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("B", [1, 16])
@pytest.mark.asyncio
async def test_decoding_rounds_match_float64(family, B, tokenizer):
    model = tiny_model(family)
    oracle = Oracle(model)
    lm = AsyncTransformer(model, tokenizer, batch_size=32)
    try:
        assert lm.forward_path == "fused"
        seen = spy_fused(lm)
        rng = random.Random(B)
        limit = 40 if family == "gpt2" else 64
        for ctxs in rounds(rng, B, [1, 4, 9, 17] if B > 1 else [17]):
            assert max(map(len, ctxs)) <= limit
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in ctxs))
            assert_matches(rows, ctxs, oracle)
        # past the shortest sliding window, over cached pasts of many lengths
        assert {n for _, n in seen} >= {1, 2} and max(d for d, _ in seen) >= 20
        assert any(d == 0 for d, _ in seen)  # the prompts' prefills ran fused too
    finally:
        lm.cleanup()


@needs_fused
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.asyncio
async def test_16_bit_weights_give_their_float32_copys_answers(family, dtype, tokenizer):
    """A model in bfloat16 (what dtype="auto" loads for most hub checkpoints) or float16
    runs fused on its 16-bit weights, half the bytes, widened exactly as they are read: every
    answer is bit for bit its float32 copy's, through decoding rounds with 1 and 2 new tokens
    over cached pasts, so against a float64 forward of the same 16-bit weights it is as
    close as a float32 model is."""
    model = tiny_model(family).to(dtype)
    widened = copy.deepcopy(model).float()
    oracle = Oracle(model)
    lm, lm32 = AsyncTransformer(model, tokenizer), AsyncTransformer(widened, tokenizer)
    try:
        assert lm.forward_path == lm32.forward_path == "fused"
        decoder, decoder32 = lm._state.decoder, lm32._state.decoder
        assert (
            decoder._impl.weight_dtype == {torch.bfloat16: "BFloat16", torch.float16: "Half"}[dtype]
        )
        assert decoder32._impl.weight_dtype == "Float"
        assert decoder.weight_bytes < 0.6 * decoder32.weight_bytes
        assert lm.kv_bytes_per_token == lm32.kv_bytes_per_token  # float32 states for both
        rng = random.Random(7)
        for ctxs in rounds(rng, 5, [1, 4, 9]):
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in ctxs))
            rows32 = await asyncio.gather(*(lm32.next_token_logprobs(c) for c in ctxs))
            for row, row32 in zip(rows, rows32):
                assert torch.equal(row, row32)
            assert_matches(rows, ctxs, oracle)
    finally:
        lm.cleanup()
        lm32.cleanup()


@needs_fused
@pytest.mark.asyncio
async def test_bfloat16_long_prefill_kept_as_float32_for_the_decoder(tokenizer):
    """A bfloat16 model's prompt longer than FusedEngine.MAX_TOKENS runs transformers' forward,
    widened to float32 (widen.py); its keys and values are stored as float32, which the fused
    steps read in place, and those steps' answers are the float32 copy's over the same stored
    states. An extension too long for the decoder runs transformers' float32 forward over
    those states. Every answer is within 1e-3 of float64 of the same bfloat16 weights."""
    model = tiny_model("llama").to(torch.bfloat16)
    widened = copy.deepcopy(model).float()
    oracle = Oracle(model)
    lm, lm32 = AsyncTransformer(model, tokenizer), AsyncTransformer(widened, tokenizer)
    lm._forwards.fused.max_tokens = 8
    try:
        seen = spy_fused(lm)
        rng = random.Random(5)
        long = [rng.randrange(3, 49000) for _ in range(30)]
        first = await lm.next_token_logprobs(long)
        assert seen == []  # the prefill ran on transformers
        assert (first.double() - oracle(long)).abs().max().item() < 1e-3
        trie = lm._kv_trie(None)
        depth, runs = trie.match(long, len(long))
        assert depth == len(long) and all(s.data.dtype == torch.float32 for s, _, _ in runs)
        # the float32 copy decodes over the very same states (copied into its trie)
        trie32 = lm32._kv_trie(None)
        at = 0
        for s, a, b in runs:
            trie32.insert(long[: at + b - a], at, s.data[:, :, :, a:b].clone(), [])
            at += b - a
        ctxs = [long + [7], long + [8, 9]]
        rows = await lm.batch_next_token_logprobs(ctxs)
        rows32 = await lm32.batch_next_token_logprobs(ctxs)
        assert seen == [(30, 1), (30, 2)]
        assert torch.equal(rows, rows32)
        for ctx, row in zip(ctxs, rows):
            assert (row.double() - oracle(ctx)).abs().max().item() < 1e-3
        longer = long + [rng.randrange(3, 49000) for _ in range(12)]
        row = await lm.next_token_logprobs(longer)
        assert len(seen) == 2  # transformers' forward, over the stored past
        assert (row.double() - oracle(longer)).abs().max().item() < 1e-3
    finally:
        lm.cleanup()
        lm32.cleanup()


@needs_fused
@pytest.mark.asyncio
async def test_long_prefill_on_transformers_then_fused_decoding(tokenizer):
    """A prompt longer than FusedEngine.MAX_TOKENS runs transformers' forward; its stored keys and
    values are then read by fused decoding steps, and a batch mixing both paths answers
    every row."""
    model = tiny_model("llama")
    oracle = Oracle(model)
    lm = AsyncTransformer(model, tokenizer)
    lm._forwards.fused.max_tokens = 8
    try:
        seen = spy_fused(lm)
        rng = random.Random(3)
        long = [rng.randrange(3, 49000) for _ in range(30)]
        short = [rng.randrange(3, 49000) for _ in range(4)]
        rows = await lm.batch_next_token_logprobs([long, short])
        assert_matches(rows, [long, short], oracle)
        assert seen == [(0, 4)]
        ctxs = [long + [7], long + [8, 9], short + [10]]
        rows = await lm.batch_next_token_logprobs(ctxs)
        assert_matches(rows, ctxs, oracle)
        assert seen[1:] == [(30, 1), (30, 2), (4, 1)]
    finally:
        lm.cleanup()


@pytest.mark.asyncio
async def test_without_kv_reuse(tokenizer):
    model = tiny_model("qwen2")
    oracle = Oracle(model)
    lm = AsyncTransformer(model, tokenizer, kv_cache_tokens=0)
    try:
        ctxs = [[5, 6, 7], [5, 6, 7, 8, 9, 10, 11], [9]]
        assert_matches(await lm.batch_next_token_logprobs(ctxs), ctxs, oracle)
    finally:
        lm.cleanup()


# ---------------------------------------------------------------------------- bad input


@pytest.mark.asyncio
async def test_position_limit(tokenizer):
    """GPT-2's learned position table has 40 rows here: a longer context is refused with an
    error naming the limit, on either path; a rotary model past max_position_embeddings
    gets what transformers computes there."""
    lm = AsyncTransformer(tiny_model("gpt2"), tokenizer)
    try:
        ok = list(range(3, 43))
        await lm.next_token_logprobs(ok)
        with pytest.raises(ValueError, match="40 positions"):
            await lm.next_token_logprobs(ok + [5])
        with pytest.raises(ValueError, match="40 positions"):
            lm.next_token_logprobs_uncached(ok + [5])
    finally:
        lm.cleanup()
    model = tiny_model("llama")  # 64 positions
    oracle = Oracle(model)
    lm = AsyncTransformer(model, tokenizer)
    try:
        ctx = [rng_token(i) for i in range(70)]
        await lm.next_token_logprobs(ctx[:60])
        ctxs = [ctx[:65], ctx]
        assert_matches(await lm.batch_next_token_logprobs(ctxs), ctxs, oracle)
    finally:
        lm.cleanup()


def rng_token(i):
    return 3 + (i * 7919) % 49000


@needs_fused
@pytest.mark.parametrize("how", ["nan weight", "overflow"])
@pytest.mark.asyncio
async def test_non_finite_model(how, tokenizer):
    """NaN or inf from the model is an error naming it, never NaN log-probabilities, and
    the bad forward leaves no key/value states behind."""
    model = tiny_model("llama")
    lm = AsyncTransformer(model, tokenizer)
    try:
        ctx = [5, 6, 7, 8]
        await lm.next_token_logprobs(ctx)
        with torch.no_grad():
            if how == "nan weight":
                model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
            else:  # activations overflow float32
                model.model.norm.weight.mul_(1e38)
        assert lm.forward_path == "fused"
        with pytest.raises(NonFiniteLogitsError, match="not finite"):
            await lm.next_token_logprobs(ctx + [9])
        with pytest.raises(NonFiniteLogitsError):
            lm.next_token_logprobs_uncached(ctx + [9])
        assert lm.forward_path == "fused"  # (the model changed: it was packed again)
        assert len(lm._kv_trie(None)) == 0
    finally:
        lm.cleanup()


@pytest.mark.parametrize(
    "case", ["finite", "sum overflows", "one nan", "one +inf", "one -inf", "row all -inf"]
)
def test_check_finite_logits(case):
    """The check raises exactly when a row holds a NaN or +inf or only -inf, as an element-wise
    test says, whatever the sum of the logits it screens them with."""
    from genlm_fast.backend.llm.checks import check_finite_logits

    logits = torch.randn(3, 1000)
    if case == "sum overflows":
        logits[:, :10] = 3e38
    elif case == "one nan":
        logits[1, 7] = float("nan")
    elif case == "one +inf":
        logits[2, 0] = float("inf")
    elif case == "one -inf":
        logits[0, 5] = float("-inf")
    elif case == "row all -inf":
        logits[1] = float("-inf")
    bad = bool(
        (torch.isnan(logits).any(1) | torch.isposinf(logits).any(1) | torch.isneginf(logits).all(1))
        .any()
        .item()
    )
    contexts = [[1, 2], [3], [4, 5, 6]]
    if bad:
        with pytest.raises(NonFiniteLogitsError, match="not finite"):
            check_finite_logits(logits, contexts)
    else:
        check_finite_logits(logits, contexts)
    assert bad == (case in ("one nan", "one +inf", "row all -inf"))


# ---------------------------------------------------------------------------- fallback, sharing


@needs_fused
@pytest.mark.asyncio
async def test_unknown_architecture_runs_transformers(tokenizer):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPTNeoXConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    oracle = Oracle(model)
    lm = AsyncTransformer(model, tokenizer)
    try:
        assert lm.forward_path.startswith("transformers (") and "gpt_neox" in lm.forward_path
        ctxs = [[5, 6, 7], [5, 6, 7, 8]]
        for _ in range(2):
            assert_matches(await lm.batch_next_token_logprobs(ctxs), ctxs, oracle)
            ctxs = [c + [9] for c in ctxs]
    finally:
        lm.cleanup()


@needs_fused
@pytest.mark.asyncio
async def test_non_float32_model_runs_transformers(tokenizer):
    model = tiny_model("llama").double()
    lm = AsyncTransformer(model, tokenizer)
    try:
        assert "float64" in lm.forward_path
        row = await lm.next_token_logprobs([5, 6, 7])
        torch.testing.assert_close(row.double(), Oracle(model)([5, 6, 7]), rtol=0, atol=1e-5)
    finally:
        lm.cleanup()


@needs_fused
@pytest.mark.asyncio
async def test_shared_model_and_cleanup(tokenizer):
    """Two AsyncTransformers over one model share one decoder; closing one leaves the other
    working; closing the last releases the packed copies."""
    model = tiny_model("gemma")
    first, second = AsyncTransformer(model, tokenizer), AsyncTransformer(model, tokenizer)
    decoder = first._state.decoder
    assert decoder is not None and second._state.decoder is decoder
    gone = weakref.ref(decoder)
    del decoder
    oracle = Oracle(model)
    ctx = [5, 6, 7, 8]
    assert_matches([await first.next_token_logprobs(ctx)], [ctx], oracle)
    first.cleanup()
    ctxs = [ctx, ctx + [9]]  # one answered before, one new: both over the shared decoder
    assert_matches(await second.batch_next_token_logprobs(ctxs), ctxs, oracle)
    assert gone() is not None
    second.cleanup()
    gc.collect()
    assert gone() is None
    from genlm_fast.backend.llm.model_state import _states

    assert model not in _states


@needs_fused
def test_describe_reasons():
    """What keeps a model off the fused path is named."""
    model = tiny_model("llama")
    model.train()
    with pytest.raises(decoder_mod.Unsupported, match="training"):
        decoder_spec.describe(model)
    model.eval()
    model.model.layers[0].mlp.act_fn = torch.nn.Tanh()
    with pytest.raises(decoder_mod.Unsupported, match="Tanh"):
        decoder_spec.describe(model)
    with pytest.raises(decoder_mod.Unsupported, match="float64 on cpu, not float32, bf"):
        decoder_spec.describe(tiny_model("qwen2").double())
    mixed = tiny_model("qwen2").to(torch.bfloat16)
    mixed.model.norm.float()
    with pytest.raises(decoder_mod.Unsupported, match="mix"):
        decoder_spec.describe(mixed)
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.intermediate_size = 73  # the down projection's input: odd
    odd = AutoModelForCausalLM.from_config(config).eval()
    decoder_spec.describe(odd)  # float32: fine
    with pytest.raises(decoder_mod.Unsupported, match="odd number of input features"):
        decoder_spec.describe(odd.to(torch.bfloat16))


@needs_fused
def test_info_names_the_forward_path(capsys):
    from genlm_fast.__main__ import info

    info()
    out = capsys.readouterr().out
    assert "AsyncTransformer CPU forward: fused decoder" in out
