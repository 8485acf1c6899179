"""A 16-bit model's transformers forward in float32 on its weights as stored (widen.py), and
the product it runs (``_C.linear_rows``): both against float64 of the same 16-bit weights."""

from __future__ import annotations

import copy

import pytest
import torch

from genlm_fast.backend.llm import widen
from genlm_fast.ops import extension

from .forward64 import LONG_PROMPT
from .small_models import small_model
from .small_models import tokenizer as tokenizer  # a fixture

_C = extension.load_module()
EPS32 = 2.0**-24


def _isas():
    if _C is None or not hasattr(_C, "linear_rows"):
        pytest.fail("genlm_fast._C was built without linear_rows")
    widening = ["baseline", "avx2", "avx512"]  # each CPU runs every ISA up to its best
    return widening[: widening.index(_C.linear_rows_best_isa()) + 1]


def _bound(x, w, b, k):
    """What float32 sums in chunks may be off by: ``(K/256 + 32 + 4)`` roundings of the
    magnitude ``|x| @ |w|^T + |b|`` (chunks of 256 over 8 lanes, or, AVX-512, of 512 over 16
    lanes: 32 products a lane, K/256 or K/512 chunk sums, 4 to add the lanes)."""
    mag = x.double().abs() @ w.double().abs().t()
    if b is not None:
        mag += b.double().abs()
    return (k / 256 + 32 + 4) * EPS32 * mag + 1e-30


SHAPES = [
    (1, 1, 1),
    (1, 7, 3),
    (3, 257, 33),
    (4, 256, 64),
    (5, 2048, 17),
    (33, 300, 65),
    (48, 519, 26),
    (2, 1100, 29),  # two rows: 8 rows of W a tile on AVX-512; three chunks and a tail
    (16, 1030, 40),  # rows in groups of 6, 5, 5
]


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_rows_is_float32_of_the_stored_weight(isa, dtype, m, k, n, with_bias):
    if isa not in _isas():
        pytest.skip(f"this CPU cannot run the {isa} kernel")
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k + 5, generator=g).to(dtype)[:, :k]  # rows apart by k + 5
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    got = _C.linear_rows(x, w, b, isa)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert ((got.double() - want).abs() <= _bound(x, w, b, k)).all()


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_linear_rows_on_a_128k_vocabulary_head(isa):
    """The LM head of a Llama-3 vocabulary (128,256 rows), bfloat16, a few rows."""
    if isa not in _isas():
        pytest.skip(f"this CPU cannot run the {isa} kernel")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g)
    w = torch.randn(128_256, 64, generator=g).bfloat16()
    got = _C.linear_rows(x, w, None, isa)
    want = x.double() @ w.double().t()
    assert ((got.double() - want).abs() <= _bound(x, w, None, 64)).all()


@pytest.mark.parametrize(
    "x, w, b, message",
    [
        (torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4, 3), None, "float32"),
        (torch.zeros(2, 3), torch.zeros(4, 3, dtype=torch.int32), None, "bfloat16 or float16"),
        (torch.zeros(2, 3), torch.zeros(4, 2), None, "3 columns"),
        (torch.zeros(2, 3), torch.zeros(2, 4, 3), None, "2-D"),
        (torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(5), r"bias must be \[4\]"),
        (torch.zeros(2, 3), torch.zeros(3, 4).t(), None, "contiguous"),
    ],
)
def test_linear_rows_rejects_bad_input(x, w, b, message):
    _isas()
    with pytest.raises(RuntimeError, match=message):
        _C.linear_rows(x, w, b, "baseline")


def test_linear_rows_rejects_an_unknown_isa():
    _isas()
    with pytest.raises(RuntimeError, match="unknown isa"):
        _C.linear_rows(torch.zeros(1, 2), torch.zeros(3, 2), None, "avx9")


def _logprobs64(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("length", [5, 100], ids=["step", "prefill"])
def test_widened_forward_is_float64_of_the_16_bit_weights(family, dtype, length):
    """Short forwards run linear_rows, long ones widened slices: both float32 from the
    embedding to the logits, within float32's error of a float64 forward of the very same
    16-bit weights, where the model's own 16-bit forward is far off."""
    model = small_model(300, family).to(dtype)
    oracle = copy.deepcopy(model).double()
    ids = torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(2)).tolist()
    want = _logprobs64(oracle, ids)
    own = _logprobs64(model, ids)
    assert widen.widen_forward(model) is None and widen.is_widened(model)
    assert widen.compute_dtype(model) == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.dtype == torch.float32
    got = torch.log_softmax(logits[0, -1].double(), -1)
    assert (got - want).abs().max() < 1e-4
    assert (own - want).abs().max() > 1e-3  # what the 16-bit forward is off by
    widen.unwiden_forward(model)
    assert not widen.is_widened(model) and widen.compute_dtype(model) == dtype
    assert torch.equal(_logprobs64(model, ids), own)


def test_without_the_extension_products_widen_slices(monkeypatch):
    """No compiled linear_rows (no compiler): every product multiplies widened slices, in
    pieces of SLICE_BYTES, with the same float32 answers."""
    model = small_model(300, "llama").to(torch.bfloat16)
    oracle = copy.deepcopy(model).double()
    monkeypatch.setattr(widen, "_rows_module", lambda: None)
    monkeypatch.setattr(widen, "SLICE_BYTES", 4 * 64 * 7)  # 7 rows a slice: several
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    widen.widen_forward(model)
    assert (_logprobs64(model, ids) - _logprobs64(oracle, ids)).abs().max() < 1e-4


def test_models_it_does_not_widen():
    model32 = small_model(300, "llama").float()
    assert widen.widen_forward(model32) == "its parameters are not bfloat16 or float16"
    assert not widen.is_widened(model32) and widen.compute_dtype(model32) == torch.float32

    model = small_model(300, "llama").to(torch.bfloat16)
    model.model.extra = torch.nn.Module()
    model.model.extra.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    reason = widen.widen_forward(model)
    assert reason is not None and "model.extra (Module)" in reason
    assert not widen.is_widened(model)
    with torch.no_grad():
        assert model(torch.tensor([[1, 2]])).logits.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def smollm2_bf16():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genlm_fast.models import smollm2_path

    path = smollm2_path(quiet=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.mark.asyncio
async def test_a_bfloat16_context_gets_float64s_answer_however_it_is_reached(smollm2_bf16):
    """SmolLM2 in bfloat16: a prompt longer than the fused forward takes, and the tokens
    after it, are within 1e-3 of float64 of the same bfloat16 weights (one float64 forward
    gives every prefix's answer), whether reached by a prefill and cached steps or by one
    forward over the whole context."""
    from genlm_fast.backend.llm import AsyncTransformer

    model, tok = smollm2_bf16
    oracle = copy.deepcopy(model).double()
    prompt = tok.encode(LONG_PROMPT)
    assert len(prompt) > 64
    lm = AsyncTransformer(model, tok)
    try:
        assert widen.is_widened(model)
        ctx = list(prompt)
        rows = [await lm.next_token_logprobs(ctx)]
        for _ in range(3):
            ctx.append(int(rows[-1].argmax()))
            rows.append(await lm.next_token_logprobs(ctx))
        with torch.no_grad():
            want = torch.log_softmax(oracle(torch.tensor([ctx])).logits[0].double(), -1)
        for i, row in enumerate(rows):
            at = len(prompt) - 1 + i
            assert (row.double() - want[at]).abs().max() < 1e-3
        lm.clear_cache()
        whole = await lm.next_token_logprobs(ctx)  # one forward, no stored past
        assert (whole - rows[-1]).abs().max() < 1e-4
    finally:
        lm.cleanup()
    assert not widen.is_widened(model)  # the last user gave the model its forward back


@pytest.mark.asyncio
async def test_an_adapter_loaded_into_a_widened_model_is_widened_too(tmp_path, tokenizer):
    """A LoRA adapter loaded into a bfloat16 model after AsyncTransformer widened it adds
    16-bit linear layers: the rebuild widens them too, and the adapter's answers are within
    float32's error of peft's float64 forward of the same weights."""
    import peft

    from genlm_fast.backend.llm import AsyncTransformer

    model = small_model(len(tokenizer), "llama").to(torch.bfloat16)
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft.get_peft_model(copy.deepcopy(model), config).save_pretrained(tmp_path / "adapter")
    base64 = copy.deepcopy(model).double()
    with_adapter64 = peft.PeftModel.from_pretrained(
        copy.deepcopy(model).double(), tmp_path / "adapter"
    ).eval()
    ctx = [5, 17, 300, 9, 12]
    lm = AsyncTransformer(model, tokenizer)
    try:
        base = await lm.next_token_logprobs(ctx)
        lm.add_new_lora(str(tmp_path / "adapter"), "adapter")
        adapted = await lm.next_token_logprobs(ctx, lora_name="adapter")
    finally:
        lm.cleanup()
    assert (base.double() - _logprobs64(base64, ctx)).abs().max() < 1e-4
    assert (adapted.double() - _logprobs64(with_adapter64, ctx)).abs().max() < 1e-4
    assert (adapted - base).abs().max() > 1e-2  # the adapter changes the answer
