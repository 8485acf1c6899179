"""The fused CPU decoder on the real SmolLM2-135M-Instruct (offline, from
`genlm_fast.models.smollm2_path`): log-probabilities within 1e-3 of transformers' float64
forward through decoding rounds over cached pasts, and the same greedy continuation as
transformers' own ``generate``."""

from __future__ import annotations

import asyncio
import gc
import random

import pytest
import torch

from genlm_fast.backend.llm import AsyncTransformer
from genlm_fast.models import smollm2_path
from tests.backend.fused import needs_fused

# on a CPU with AVX-512F a missing or broken decoder fails (test_decoder.py says why)
pytestmark = [pytest.mark.slow, needs_fused]

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n <",
    "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.fixture(scope="module")
def lm():
    model = AsyncTransformer.from_name(smollm2_path())
    yield model
    model.cleanup()


@pytest.fixture(scope="module")
def ref64():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32).double().eval()


def logprobs64(model, ctx):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([list(ctx)])).logits[0, -1], -1)


def assert_within_1e3(row, ctx, model):
    """``row`` within 1e-3 of ``model``'s float64 log-probabilities after ``ctx``, on every
    token (the LM head's ragged last panel included), plus 1e-4 of the magnitude for the
    unlikely ones (float32 logits of size ~30 carry ~1e-5 of it); returns those."""
    want = logprobs64(model, ctx)
    assert row.shape == want.shape and torch.isfinite(row).all()
    err = (row.double() - want).abs() - 1e-4 * want.abs()
    worst = int(err.argmax())
    assert err[worst] < 1e-3, f"{len(ctx)} tokens: token {worst}: {row[worst]} vs {want[worst]}"
    return want


@pytest.mark.asyncio
async def test_decoding_rounds_within_1e3_of_float64(lm, ref64):
    assert lm.forward_path == "fused"
    lm.clear_cache()
    rng = random.Random(0)
    prompts = [lm.tokenizer.encode(t) for t in TEXTS]
    # 16 particles over the four prompts; rounds of 1 and 2 new tokens, resampling between
    rows = [list(prompts[i % 4]) for i in range(16)]
    checked = 0
    for step in range(4):
        got = await asyncio.gather(*(lm.next_token_logprobs(r) for r in rows))
        for r, row in zip(rows, got):
            assert_within_1e3(row, r, ref64)
            checked += 1
        grow = 1 + step % 2
        rows = [list(rng.choice(rows)) for _ in rows]
        for r in rows:
            r.extend(rng.randrange(100, 40000) for _ in range(grow))
    assert checked == 64


def test_greedy_continuation_as_transformers(lm):
    """Greedy decoding, one cached token at a time, gives the tokens transformers'
    ``generate`` does."""
    lm.clear_cache()
    for text in TEXTS[:3]:
        ctx = lm.tokenizer.encode(text)
        with torch.no_grad():
            want = lm.model.generate(
                torch.tensor([ctx]),
                max_new_tokens=24,
                do_sample=False,
                pad_token_id=lm.tokenizer.eos_token_id,
            )[0, len(ctx) :].tolist()
        got = list(ctx)
        for _ in range(24):
            got.append(int(lm.next_token_logprobs_sync(got).argmax()))
        assert got[len(ctx) :] == want, lm.tokenizer.decode(want)


@pytest.mark.asyncio
async def test_long_prompt_then_fused_steps(lm, ref64):
    """A prompt over FusedEngine.MAX_TOKENS is prefilled by transformers' forward; the fused
    decoder continues from its stored keys and values."""
    lm.clear_cache()
    prompt = lm.tokenizer.encode(" ".join(TEXTS) * 3)
    assert len(prompt) > lm._forwards.fused.max_tokens
    await lm.next_token_logprobs(prompt)
    ctxs = [prompt + [100], prompt + [200, 300]]
    got = await lm.batch_next_token_logprobs(ctxs)
    for ctx, row in zip(ctxs, got):
        assert_within_1e3(row, ctx, ref64)


@pytest.mark.asyncio
async def test_cached_answers_are_the_uncached_forward_bit_for_bit(lm):
    """The fused forward is row- and batch-invariant: a context that extends a cached one,
    asked alone or in a batch of rows with other pasts, gets exactly the log-probabilities
    of one forward over the whole context (`next_token_logprobs_uncached`), which genlm's
    own suite asks of a KV-reusing backend. The independent check of those numbers is the
    float64 test above."""
    lm.clear_cache()
    tok = lm.tokenizer
    pre = tok.encode("There might be something wrong")
    prompt = pre + tok.encode(" with the caching logic", add_special_tokens=False)
    for ctx in (pre, prompt, [*prompt, 42], [*prompt, 42, 43, 44]):
        have = await lm.next_token_logprobs(ctx)
        assert torch.equal(have, lm.next_token_logprobs_uncached(ctx)), len(ctx)
    ctxs = [[*prompt, 7], [*pre, 9, 10], [*prompt, 42, 43, 44, 45], list(pre)]
    rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in ctxs))
    for ctx, have in zip(ctxs, rows):
        assert torch.equal(have, lm.next_token_logprobs_uncached(ctx)), len(ctx)


@pytest.mark.asyncio
async def test_bfloat16_smollm2_within_1e3_of_float64_of_its_weights():
    """SmolLM2 loaded in bfloat16 (as dtype="auto" loads the hub checkpoint) runs fused on
    its bfloat16 weights: through decoding rounds every log-probability is within 1e-3 of a
    float64 forward of those weights, as for the float32 model (transformers' own bfloat16
    forward is tenths of a nat away), and the greedy continuation is the float64 one."""
    from transformers import AutoModelForCausalLM

    lm = AsyncTransformer.from_name(smollm2_path(), hf_opts={"dtype": torch.bfloat16})
    try:
        assert lm.forward_path == "fused"
        assert lm._state.decoder._impl.weight_dtype == "BFloat16"
        ref = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.bfloat16)
        ref = ref.double().eval()
        rows = [lm.tokenizer.encode(t) for t in TEXTS]
        for _ in range(3):
            got = await asyncio.gather(*(lm.next_token_logprobs(r) for r in rows))
            for r, row in zip(rows, got):
                want = assert_within_1e3(row, r, ref)
                top2 = want.topk(2).values
                if top2[0] - top2[1] > 1e-3:  # not a tie within the tolerance
                    assert int(row.argmax()) == int(want.argmax())
                r.append(int(want.argmax()))
    finally:
        lm.cleanup()


def _resident_share(model):
    """The share of the model's matrices' bytes whose pages are resident in this process."""
    from genlm_fast.backend.llm.file_pages import resident_bytes

    mats = {p.data_ptr(): p for p in model.parameters() if p.dim() == 2}.values()
    return sum(resident_bytes(p) for p in mats) / sum(p.numel() * p.element_size() for p in mats)


@pytest.mark.asyncio
async def test_the_packed_copy_is_the_one_resident_copy(lm, ref64):
    """Loaded in its own dtype, the model's weights are mapped from the checkpoint: once
    packed, their pages go back to the file. A long prompt runs transformers' forward, whose
    layers (and the tied embedding) read the panels, so the pages stay out; its answers and
    the fused steps after it are float64's."""
    assert _resident_share(lm.model) < 0.02
    lm.clear_cache()
    prompt = lm.tokenizer.encode(" ".join(TEXTS[::-1]) * 3)
    assert len(prompt) > lm._forwards.fused.max_tokens
    assert_within_1e3(await lm.next_token_logprobs(prompt), prompt, ref64)
    ctx = prompt + [100]
    assert_within_1e3(await lm.next_token_logprobs(ctx), ctx, ref64)
    assert _resident_share(lm.model) < 0.02


@pytest.mark.asyncio
async def test_an_edit_of_mapped_weights_is_kept_and_packed():
    """An in-place edit through ``.data`` (behind the version counter, as peft's merge
    writes) of weights mapped from the file: the watch sees it and the decoder repacks, and
    the edited pages, private copies now, are not given back (which would turn them into
    the file's content again)."""
    from transformers import AutoModelForCausalLM

    lm = AsyncTransformer.from_name(smollm2_path())
    try:
        ctx = lm.tokenizer.encode(TEXTS[0])
        before = lm.next_token_logprobs_uncached(ctx)  # (the output cache keeps no answer)
        weight = lm.model.model.layers[3].mlp.down_proj.weight
        weight.data.mul_(0.5)
        after = await lm.next_token_logprobs(ctx)
        ref = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
        ref.model.layers[3].mlp.down_proj.weight.data.mul_(0.5)
        assert torch.equal(weight, ref.model.layers[3].mlp.down_proj.weight)
        assert_within_1e3(after, ctx, ref.double().eval())
        assert (after - before).abs().max() > 1e-2  # the edit shows in the answers
    finally:
        lm.cleanup()


@pytest.mark.asyncio
async def test_the_panels_end_on_2mb_pages_with_the_same_answers(ref64):
    """The packed copy is filled on ordinary pages and gathered into 2 MB pages on idle CPUs
    after loading (`packed_pages`): the gathering ends with the panels in huge pages, as the
    kernel accounts them, and the answers over them are still float64's. Closing the LM ends
    a gathering under way."""
    from tests.backend.test_packed_pages import _huge_bytes, _kernel_collapses

    lm = AsyncTransformer.from_name(smollm2_path())
    try:
        assert lm.settle(timeout=300)
        if _kernel_collapses():
            panels = lm._state.decoder._panels
            assert _huge_bytes(panels) >= panels.numel() * panels.element_size() - 4 * (2 << 20)
        for text in TEXTS:
            ctx = lm.tokenizer.encode(text)
            assert_within_1e3(await lm.next_token_logprobs(ctx), ctx, ref64)
    finally:
        lm.cleanup()
    other = AsyncTransformer.from_name(smollm2_path())
    gathering = other._state.decoder.huge_pages
    other.cleanup()
    gc.collect()
    assert gathering.wait(timeout=0) and other.settle(timeout=0)
