"""Weights edited after the fused CPU decoder packed them: `ModelWatch` sees each kind of
change (and none where there is none), compiled and in Python, float32 and bfloat16; the
next forward computes with the new weights (against transformers' float64 forward of the
edited model) and reuses no key/value state cached before; a peft adapter injected, then
merged."""

from __future__ import annotations

import pytest
import torch

from genlm_fast.backend.llm import AsyncTransformer, model_state
from tests.backend.fused import needs_fused
from tests.backend.small_models import tokenizer as tokenizer  # a fixture
from tests.backend.tiny_decoders import (
    ATOL,
    Oracle,
    assert_matches,
    tiny_model,
)
from tests.ops.devices import require_cpu_extension


def _edit_in_place(model):
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)


def _edit_data(model):  # behind the version counter, as peft's merge does
    w = model.model.layers[1].mlp.up_proj.weight
    w.data += 0.2 * torch.randn_like(w)


def _edit_few_entries(model):  # a handful of entries of small tensors, through .data
    model.model.layers[0].mlp.down_proj.weight.data[:2, :3] += 1.0
    model.model.norm.weight.data[4] += 2.0


def _announced(model):  # a few entries of a large weight (the embedding), then said
    model.model.embed_tokens.weight.data[5:12, :3] += 1.0
    return "announce"


def _replace_parameter(model):
    layer = model.model.layers[1].self_attn.o_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach() * -1.0)


def _load_state_dict(model):
    state = {k: v * 0.9 for k, v in model.state_dict().items()}
    model.load_state_dict(state)


def _inject_submodule(model):  # what an adapter library does: a layer replaced by another
    layer = model.model.layers[0].self_attn
    layer.q_proj = torch.nn.Sequential(layer.q_proj)


def _drop_bias(model):  # a parameter slot set to None
    model.model.layers[0].mlp.gate_proj.register_parameter("bias", None)
    model.model.layers[0].mlp.gate_proj.extra = torch.nn.Parameter(torch.zeros(2))


def _swap_dict_entry(model):  # behind __setattr__: the module's own dict edited
    proj = model.model.layers[1].mlp.down_proj
    proj._parameters["weight"] = torch.nn.Parameter(proj.weight.detach().clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize(
    "edit",
    [
        None,
        _edit_in_place,
        _edit_data,
        _replace_parameter,
        _inject_submodule,
        _drop_bias,
        _swap_dict_entry,
        _load_state_dict,
    ],
)
def test_model_watch(edit, compiled, dtype, monkeypatch):
    """ModelWatch sees each kind of change (and none where there is none), both the compiled
    check and the Python one the package falls back to without the extension, on float32
    and bfloat16 weights; the compiled one names the first dict or parameter that changed."""
    if not compiled:
        monkeypatch.setattr(model_state, "_watch_module", lambda: None)
    else:
        require_cpu_extension()
        assert model_state._watch_module() is not None, "genlm_fast._C has no WeightWatch"
    model = tiny_model("llama").to(dtype)
    watch = model_state.ModelWatch(model)
    assert (watch._impl is not None) == compiled
    assert not watch.changed() and not watch.changed()
    if edit is None:
        return
    dicts_before = [(d, list(items)) for d, items in watch._dicts]
    edit(model)
    assert watch.changed()
    if compiled:
        # the oracle: the first dict whose items are no longer the same objects, else the
        # number of dicts (the parameters come after them)
        first = next(
            (
                i
                for i, (d, items) in enumerate(dicts_before)
                if len(d) != len(items) or any(d.get(k) is not v for k, v in items)
            ),
            len(dicts_before),
        )
        got = watch._impl.changed()
        assert got == first if first < len(dicts_before) else got >= first


@needs_fused
@pytest.mark.parametrize(
    "edit",
    [
        _edit_in_place,
        _edit_data,
        _edit_few_entries,
        _replace_parameter,
        _load_state_dict,
        _announced,
    ],
)
@pytest.mark.asyncio
async def test_weights_changed_after_packing(edit, tokenizer):
    """An edit of the weights after the decoder packed them (in place, through .data,
    replacing a parameter, load_state_dict, or announced with reload_weights): the next
    forward computes with the new weights, and key/value states cached before are not
    reused."""
    model = tiny_model("llama")
    lm = AsyncTransformer(model, tokenizer)
    try:
        ctxs = [[5, 6, 7, 8, 9], [5, 6, 7, 10]]
        await lm.batch_next_token_logprobs(ctxs)
        if edit(model) == "announce":
            lm.reload_weights()
        oracle = Oracle(model)
        later = [c + [11] for c in ctxs]  # would reuse the cached pasts
        assert_matches(await lm.batch_next_token_logprobs(later), later, oracle)
        assert lm.forward_path == "fused"
    finally:
        lm.cleanup()


@needs_fused
@pytest.mark.asyncio
async def test_peft_adapter_injected_then_merged(tokenizer):
    """peft wrapping the model's layers (get_peft_model) sends forwards to transformers'
    path; merge_and_unload puts plain layers back with merged weights, and the fused path
    computes with them."""
    import peft  # a test dependency: never skipped

    model = tiny_model("llama")
    lm = AsyncTransformer(model, tokenizer)
    try:
        ctx = [5, 6, 7, 8]
        await lm.next_token_logprobs(ctx)
        torch.manual_seed(1)
        wrapped = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
            ),
        )
        wrapped.eval()
        want = torch.log_softmax(wrapped(torch.tensor([ctx + [9]])).logits[0, -1].double(), -1)
        row = await lm.next_token_logprobs(ctx + [9])
        assert lm.forward_path.startswith("transformers")
        assert (row.double() - want).abs().max().item() < ATOL
        merged = wrapped.merge_and_unload()
        assert merged is model
        oracle = Oracle(model)
        assert_matches([await lm.next_token_logprobs(ctx + [9, 10])], [ctx + [9, 10]], oracle)
        assert lm.forward_path == "fused"
    finally:
        lm.cleanup()
