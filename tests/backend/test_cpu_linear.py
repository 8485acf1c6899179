"""oneDNN packed linear layers (genlm_fast.backend.llm.cpu_linear) against float64 F.linear,
on small layers and on the real SmolLM2 through AsyncTransformer."""

import pytest
import torch
import torch.nn.functional as F

from genlm_fast.backend.llm import cpu_linear
from genlm_fast.backend.llm.cpu_linear import (
    onednn_linear_available,
    pack_linear_layers,
    unpack_linear_layers,
)

needs_onednn = pytest.mark.skipif(not onednn_linear_available(),
                                  reason="this torch build has no oneDNN packed linear")


def float64_linear(layer, x):
    bias = None if layer.bias is None else layer.bias.double()
    return F.linear(x.double(), layer.weight.double(), bias)


def small_model(bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 130, bias=bias), torch.nn.Tanh(),
                               torch.nn.Linear(130, 9, bias=False))


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 37), (9, 37), (3, 5, 37), (0, 37)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64(shape, bias):
    model = small_model(bias)
    assert pack_linear_layers(model) == 2
    assert all("forward" in m.__dict__ for m in model if isinstance(m, torch.nn.Linear))
    x = torch.randn(*shape)
    with torch.no_grad():
        got = model(x)
        want = float64_linear(model[2], torch.tanh(float64_linear(model[0], x)).float())
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 9)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_follows_weight_changes():
    layer = torch.nn.Linear(16, 24)
    pack_linear_layers(layer)
    x = torch.randn(4, 16)
    with torch.no_grad():
        layer(x)  # packs
        layer.weight.mul_(-2.0)  # in place: the version counter moves
        torch.testing.assert_close(layer(x).double(), float64_linear(layer, x), rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(24, 16))  # replaced
        torch.testing.assert_close(layer(x).double(), float64_linear(layer, x), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_follows_edits_behind_the_version_counter():
    """Edits through ``.data`` move neither the version counter nor (in place) the storage:
    peft's merge_adapter does ``weight.data += delta``. The sampled snapshot sees edits of
    the whole tensor; forget_packed_weights covers the rest."""
    layer = torch.nn.Linear(40, 300)
    pack_linear_layers(layer)
    x = torch.randn(5, 40)

    def check():
        torch.testing.assert_close(layer(x).double(), float64_linear(layer, x), rtol=1e-5,
                                   atol=1e-5)

    with torch.no_grad():
        check()  # packs
        layer.weight.data.mul_(0.5)
        check()
        layer.weight.data += torch.randn(300, 40) * 0.1  # a dense delta, as a LoRA merge
        check()
        layer.weight.data = torch.randn(300, 40)  # a new storage under the same Parameter
        check()
        layer.weight.data[7, 3] += 1.0  # one entry, between the sampled ones:
        assert (7 * 40 + 3) % (300 * 40 // cpu_linear._PROBE_SIZE) != 0
        assert (layer(x) - float64_linear(layer, x).float()).abs().max() > 0.1  # not seen
        cpu_linear.forget_packed_weights(layer)
        check()


@needs_onednn
def test_inference_mode_weights():
    """A model built under ``torch.inference_mode`` has inference-tensor weights, which have
    no version counter (reading ``_version`` raises): the packed path must still work, in and
    out of inference mode, and follow edits made under inference mode."""
    with torch.inference_mode():
        model = small_model()
    assert model[0].weight.is_inference()
    assert pack_linear_layers(model) == 2
    x = torch.randn(6, 37)

    def check():
        want = float64_linear(model[2], torch.tanh(float64_linear(model[0], x)).float())
        torch.testing.assert_close(model(x).double(), want, rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        check()
    with torch.inference_mode():
        check()
        model[0].weight.mul_(-0.5)  # in place, and no version counter to move
        check()


@needs_onednn
def test_packed_model_copies_and_pickles():
    """A packed model is still the caller's model: copy.deepcopy and torch.save/torch.load
    work after it has run (its packed copies are opaque oneDNN tensors, which neither copy
    nor pickle), and the copy is a packed model of its own, bound to its own weights."""
    import copy
    import io

    model = small_model()
    pack_linear_layers(model)
    x = torch.randn(4, 37)

    def want(m):
        return float64_linear(m[2], torch.tanh(float64_linear(m[0], x)).float())

    with torch.no_grad():
        before = model(x)  # packs
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        copies = [copy.deepcopy(model), torch.load(buf, weights_only=False)]
        for twin in copies:
            torch.testing.assert_close(twin(x).double(), want(model), rtol=1e-5, atol=1e-5)
            assert "forward" in twin[0].__dict__  # still packed
            twin[0].weight.mul_(-1.0)  # the copy follows its own weights...
            torch.testing.assert_close(twin(x).double(), want(twin), rtol=1e-5, atol=1e-5)
        assert torch.equal(model(x), before)  # ...and the original is untouched
    unpack_linear_layers(copies[0])
    assert "forward" not in copies[0][0].__dict__


@needs_onednn
def test_converted_model_drops_its_stale_copies():
    """After model.to(bfloat16) the float32 packed copies (and the old float32 weights their
    snapshots keep alive: as much memory again as the model) are released by the first
    product in the new dtype, not held until a float32 product that may never come. A
    float32 input against a bfloat16 weight gets torch's own dtype error, not oneDNN's."""
    model = small_model()
    pack_linear_layers(model)
    linears = [model[0], model[2]]
    x = torch.randn(3, 37)
    with torch.no_grad():
        model(x)  # packs
        assert all(cpu_linear._PACK in m.__dict__ for m in linears)
        model.to(torch.bfloat16)
        reference = small_model().to(torch.bfloat16)  # the same weights, never packed
        torch.testing.assert_close(model(x.bfloat16()), reference(x.bfloat16()), rtol=0, atol=0)
        assert not any(cpu_linear._PACK in m.__dict__ for m in linears)
        with pytest.raises(RuntimeError, match="dtype"):
            model[0](x)
        model.float()  # back: packs afresh, from the (rounded) float32 weights
        want = float64_linear(model[2], torch.tanh(float64_linear(model[0], x)).float())
        torch.testing.assert_close(model(x).double(), want, rtol=1e-5, atol=1e-5)
        assert all(cpu_linear._PACK in m.__dict__ for m in linears)


@needs_onednn
def test_other_inputs_use_torch():
    layer = torch.nn.Linear(8, 3)
    pack_linear_layers(layer)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()  # autograd: F.linear, so gradients flow
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(2, 8))
    assert layer.weight.grad is not None
    with torch.no_grad():
        y = layer.double()(torch.randn(2, 8, dtype=torch.float64))
    assert y.dtype == torch.float64
    double = torch.nn.Linear(8, 3).double()
    assert pack_linear_layers(double) == 0  # only float32 layers are packed


def test_switch_and_undo(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "torch")
    model = small_model()
    assert pack_linear_layers(model) == 0
    assert not any("forward" in m.__dict__ for m in model)
    monkeypatch.setenv(cpu_linear.ENV, "mkl")
    with pytest.raises(ValueError, match="GENLM_FAST_CPU_LINEAR"):
        pack_linear_layers(model)
    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    n = pack_linear_layers(model)
    assert n == (2 if onednn_linear_available() else 0)
    with torch.no_grad():
        model(torch.randn(2, 37))
    unpack_linear_layers(model)
    assert not any("forward" in m.__dict__ or cpu_linear._PACK in m.__dict__ for m in model)


@needs_onednn
@pytest.mark.slow
def test_smollm2_packed_and_given_back():
    """The real model: AsyncTransformer packs every linear layer (so its float64 accuracy
    tests run on the packed path), the packed forward agrees with torch's, and cleanup
    gives the caller's model its own layers back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genlm_fast.backend.llm import AsyncTransformer
    from genlm_fast.models import smollm2_path

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([AutoTokenizer.from_pretrained(path).encode("The capital of France is")])
    with torch.no_grad():
        plain = model(ids).logits
    lm = AsyncTransformer(model, AutoTokenizer.from_pretrained(path))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert lm._packed_linears == len(linears) > 200
    with torch.no_grad():
        packed = model(ids).logits
    torch.testing.assert_close(packed.log_softmax(-1), plain.log_softmax(-1), rtol=0, atol=5e-4)
    assert int(packed[0, -1].argmax()) == int(plain[0, -1].argmax())
    lm.cleanup()
    assert not any("forward" in m.__dict__ for m in linears)
