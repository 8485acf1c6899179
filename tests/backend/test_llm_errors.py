"""Error handling of the LM backends, driven by MockAsyncLM: bad contexts and sampling
arguments, a closed model, pickling, constructor checks, unsupported backends and the
lazy exports.

The mock runs through exactly the batcher and caches AsyncTransformer uses; every row
is checked against an independent computation of the mock's distribution
(tests/backend/llm_mock_support.py)."""

import asyncio

import numpy as np
import pytest
import torch

from genlm_fast.backend.llm import (
    AsyncVirtualLM,
    MockAsyncLM,
    ModelClosedError,
    QueriesResetError,
    UnknownLoraError,
    load_model_by_name,
)
from tests.backend.llm_mock_support import decode_once as decode_once  # autouse
from tests.backend.llm_mock_support import expected, make
from tests.backend.llm_mock_support import tokenizer as tokenizer  # a fixture
from tests.backend.llm_mock_support import vocab_size as vocab_size  # a fixture

# the vocabulary is decoded once per tokenizer: the tests build many fresh models


@pytest.mark.asyncio
async def test_bad_contexts(tokenizer, vocab_size):
    lm = make(tokenizer)
    with pytest.raises(ValueError, match="vocabulary"):
        await lm.next_token_logprobs([1, vocab_size])
    with pytest.raises(ValueError, match="vocabulary"):
        lm.next_token_logprobs_sync([-1])
    with pytest.raises(ValueError, match="vocabulary"):
        await lm.batch_next_token_logprobs([[1], [vocab_size + 5]])
    for bad in (
        "hello",
        [1.5, 2],
        [[1, 2]],
        [True, 1],
        None,
        3,
        [1, "2"],
        [torch.tensor(1.0)],
        [torch.tensor(True)],
        [torch.tensor([1])],
        [np.array(2.0)],
        [np.bool_(True)],
    ):
        with pytest.raises(TypeError, match="token_ids"):
            await lm.next_token_logprobs(bad)
        with pytest.raises(TypeError, match="token_ids"):
            lm.next_token_logprobs_sync(bad)
    with pytest.raises(TypeError):
        await lm.next_token_logprobs(torch.tensor([1.0, 2.0]))
    for call in (lm.batch_next_token_logprobs, lm.batch_next_token_logits):
        # no contexts, no rows to stack (genlm: torch's "stack expects a non-empty TensorList")
        with pytest.raises(ValueError, match=f"{call.__name__} needs at least one context"):
            await call([])
    with pytest.raises(ValueError, match="needs at least one context"):
        lm.batch_next_token_logprobs_sync(iter([]))
    for bad in (None, 3, "hello"):  # batch calls: a list of contexts (None was an empty batch)
        for call in (lm.batch_next_token_logprobs, lm.batch_next_token_logits):
            with pytest.raises(TypeError, match="list of token_ids contexts"):
                await call(bad)
        with pytest.raises(TypeError, match="list of token_ids contexts"):
            lm.batch_next_token_logprobs_sync(bad)
        with pytest.raises(TypeError, match="list of token_ids contexts"):
            await lm.batch_sample(bad, 2, [0])
    for bad in (
        0,
        0.0,
        -1.0,
        float("inf"),
        float("nan"),
        None,
        True,
        "1",
        torch.tensor([0.5, 0.5]),
        torch.tensor(float("nan")),
    ):
        # 0 divided by zero (torch's 'probability tensor contains inf'), -1 sampled from
        # the inverted distribution
        with pytest.raises(ValueError, match="temperature must be a positive"):
            await lm.sample([1, 2], 3, [0], temperature=bad)
        with pytest.raises(ValueError, match="temperature must be a positive"):
            await lm.batch_sample([[1, 2]], 3, [0], temperature=bad)
    for kwargs, error, message in [
        ({"max_tokens": 2.5}, TypeError, "max_tokens must be an int"),
        ({"max_tokens": "3"}, TypeError, "max_tokens must be an int"),
        ({"eos_token_ids": None}, TypeError, "eos_token_ids must be a collection"),
        ({"eos_token_ids": 5}, TypeError, "eos_token_ids must be a collection"),
        ({"eos_token_ids": [1.5]}, TypeError, "eos_token_ids must hold ints"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"seed": "7"}, TypeError, "seed must be an int"),
        ({"seed": 2**70}, ValueError, "seed must lie in"),
    ]:
        args = {"max_tokens": 3, "eos_token_ids": [0], **kwargs}
        with pytest.raises(error, match=message):
            await lm.sample([1, 2], **args)
        with pytest.raises(error, match=message):
            await lm.batch_sample([[1, 2]], **args)
    # numpy integers, tensors and one-pass iterables are fine, and mean what lists do
    want = await lm.sample([1, 2], 4, [7, 9], seed=5)
    assert await lm.sample([1, 2], np.int64(4), np.array([7, 9]), seed=np.int64(5)) == want
    assert await lm.batch_sample([[1, 2], [1, 2]], 4, iter([7, 9]), seed=5) == [want] * 2
    assert await lm.sample([1, 2], 4, torch.tensor([7, 9]), seed=5) == want
    # integer arrays and tensors are fine, and equal to lists
    a = await lm.next_token_logprobs(np.array([4, 5], dtype=np.int64))
    b = await lm.next_token_logprobs(torch.tensor([4, 5]))
    c = await lm.next_token_logprobs((np.int32(4), 5))
    # items that are 0-d integer tensors or arrays, as ctx + [logps.argmax()] makes them
    d = await lm.next_token_logprobs([torch.tensor(4), torch.tensor(5, dtype=torch.int32)])
    e = lm.next_token_logprobs_sync([np.array(4), 5])
    for r in (a, b, c, d, e):
        torch.testing.assert_close(r, expected([4, 5], vocab_size))
    with pytest.raises(UnknownLoraError):
        await lm.next_token_logprobs([1], lora_name="nope")
    with pytest.raises(ValueError):  # UnknownLoraError is a ValueError, as in genlm
        lm.next_token_logprobs_sync([1], lora_name="nope")
    assert not lm._pending


@pytest.mark.asyncio
async def test_cleanup_then_any_call_raises(tokenizer):
    lm = make(tokenizer, batch_size=100, timeout=30.0)
    waiting = asyncio.create_task(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0)
    lm.cleanup()
    with pytest.raises(QueriesResetError):
        await asyncio.wait_for(waiting, 5)
    lm.cleanup()  # idempotent
    with pytest.raises(ModelClosedError):
        await lm.next_token_logprobs([1])
    with pytest.raises(ModelClosedError):
        lm.next_token_logprobs_sync([1])
    with pytest.raises(ModelClosedError):
        await lm.batch_next_token_logprobs([[1]])
    with pytest.raises(ModelClosedError):
        lm.batch_next_token_logprobs_sync([[1]])
    with pytest.raises(ModelClosedError):
        await lm.next_token_logits([1])
    with pytest.raises(ModelClosedError):
        await lm.sample([1], 3, [0])
    with pytest.raises(ModelClosedError), lm:
        pass


@pytest.mark.asyncio
async def test_context_managers(tokenizer):
    with make(tokenizer) as lm:
        lm.next_token_logprobs_sync([1])
    with pytest.raises(ModelClosedError):
        lm.next_token_logprobs_sync([1])
    async with make(tokenizer) as lm2:
        await lm2.next_token_logprobs([1])
    with pytest.raises(ModelClosedError):
        await lm2.next_token_logprobs([1])


def test_pickling_or_copying_names_the_model(tokenizer):
    import copy
    import pickle

    lm = make(tokenizer)
    lm.next_token_logprobs_sync([1])
    holder = {"particle": [1, 2], "model": lm}  # what an app's state may look like
    for attempt in (
        lambda: pickle.dumps(lm),
        lambda: copy.deepcopy(lm),
        lambda: copy.copy(lm),
        lambda: copy.deepcopy(holder),
        lambda: pickle.dumps(holder),
    ):
        with pytest.raises(TypeError, match="MockAsyncLM cannot be pickled or copied"):
            attempt()
    assert copy.copy(holder)["model"] is lm  # a shallow copy shares the model, as ever


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"batch_size": 2.5}, "batch_size must be a positive integer"),
        ({"batch_size": "3"}, "batch_size must be a positive integer"),
        ({"batch_size": True}, "batch_size must be a positive integer"),
        ({"timeout": -1}, "timeout must be a finite non-negative"),
        ({"timeout": float("nan")}, "timeout must be a finite non-negative"),
        ({"timeout": float("inf")}, "timeout must be a finite non-negative"),
        ({"timeout": None}, "timeout must be a finite non-negative"),
        ({"timeout": "0.1"}, "timeout must be a finite non-negative"),
        ({"cache_size": 1.5}, "cache_size must be an integer"),
    ],
)
def test_constructor_checks(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        MockAsyncLM(tokenizer, **kwargs)


def test_constructor_accepts_numpy_numbers(tokenizer, vocab_size):
    lm = MockAsyncLM(
        tokenizer, batch_size=np.int64(4), timeout=np.float32(0.01), cache_size=np.int32(8)
    )
    assert (lm.batch_size, lm.timeout, lm.cache_size) == (4, pytest.approx(0.01), 8)
    torch.testing.assert_close(lm.next_token_logprobs_sync([3]), expected([3], vocab_size))


def test_load_model_by_name(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    lm = load_model_by_name(str(tmp_path), backend="mock")
    assert isinstance(lm, MockAsyncLM) and len(lm.byte_vocab) == len(tokenizer)
    # ImportError, as genlm raises where MLX / SGLang are not installed (so an app's
    # fallback runs), and NotImplementedError
    for backend in ("mlx", "sgl"):
        for error in (ImportError, NotImplementedError):
            with pytest.raises(error, match="genlm_fast does not support"):
                load_model_by_name("gpt2", backend=backend)
    # genlm's class names import (genlm-control does `from genlm.backend.llm import
    # AsyncMlxLM` for backend="mlx"), and using them says why they cannot be used
    from genlm_fast.backend.llm import AsyncMlxLM, AsyncSGLTransformer

    for cls in (AsyncMlxLM, AsyncSGLTransformer):
        with pytest.raises(ImportError, match="genlm_fast does not support"):
            cls.from_name("gpt2")
        with pytest.raises(NotImplementedError, match="genlm_fast does not support"):
            cls()
    with pytest.raises(ValueError, match="Invalid backend"):
        load_model_by_name("gpt2", backend="tpu")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="vllm is not installed"):
            load_model_by_name("gpt2", backend="vllm")
        with pytest.raises(ImportError, match="vllm is not installed"):
            AsyncVirtualLM.from_name("gpt2")
        with pytest.raises(ImportError, match="vllm is not installed"):
            AsyncVirtualLM(llm=None)


def test_lazy_backend_exports():
    import subprocess
    import sys

    code = (
        "import sys, genlm_fast.backend as b; assert 'torch' not in sys.modules; "
        "assert b.load_model_by_name and b.AsyncLM and b.MockAsyncLM and b.AsyncTransformer; "
        "assert b.AsyncVirtualLM.__name__ == 'AsyncVirtualLM'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
