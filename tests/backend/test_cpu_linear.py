"""The CPU linear layers (genlm_fast.backend.llm.cpu_linear) against float64 F.linear, on
each kernel that runs here: genlm_fast's small-batch kernel on packed panels
(csrc/linear_cpu.cpp, also called raw, on each of its ISAs) and linear_rows on the weight in
place (csrc/linear_rows_cpu.cpp; raw calls in test_widen.py); on small layers and on the real
SmolLM2 through AsyncTransformer."""

import pytest
import torch
import torch.nn.functional as F

from genlm_fast.backend.llm import cpu_linear, widen
from genlm_fast.backend.llm.cpu_linear import (
    available_kernels,
    pack_linear_layers,
    unpack_linear_layers,
)
from genlm_fast.ops import extension


def _built():
    """genlm_fast._C, which scripts/setup.sh builds: its absence fails a test, never skips
    it."""
    module = extension.load_module()
    if module is None:
        pytest.fail(f"genlm_fast._C is unavailable: {extension.why_missing('cpu')}")
    return module


def _cpu_has_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@pytest.fixture(params=cpu_linear.KERNELS)
def kernel(request):
    """Each kernel in turn, passed to pack_linear_layers."""
    if (request.param == "avx512" and _cpu_has_avx512()) or (
        request.param == "rows" and torch.backends.cpu.get_cpu_capability() != "DEFAULT"
    ):
        _built()  # the CPU runs it: a missing build is a failure
    if request.param not in available_kernels():
        pytest.skip(
            f"the {request.param} kernel does not run here (avx512: needs "
            "genlm_fast._C and AVX-512F; rows: genlm_fast._C and AVX2)"
        )
    return request.param


def float64_linear(layer, x):
    bias = None if layer.bias is None else layer.bias.double()
    return F.linear(x.double(), layer.weight.double(), bias)


def small_model(bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(37, 130, bias=bias), torch.nn.Tanh(), torch.nn.Linear(130, 9, bias=False)
    )


# rows: one, a few, a full AVX-512 group (24) and one more, the small-batch limit (48) and
# one more (then F.linear), in 2-D and 3-D, and none
@pytest.mark.parametrize(
    "shape", [(1, 37), (9, 37), (24, 37), (25, 37), (48, 37), (49, 37), (3, 5, 37), (0, 37)]
)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64(shape, bias, kernel):
    model = small_model(bias)
    assert pack_linear_layers(model, kernel) == 2
    assert all("forward" in m.__dict__ for m in model if isinstance(m, torch.nn.Linear))
    x = torch.randn(*shape)
    with torch.no_grad():
        got = model(x)
        want = float64_linear(model[2], torch.tanh(float64_linear(model[0], x)).float())
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 9)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    rows = x.numel() // x.shape[-1]
    if kernel == "avx512":
        packed = 0 < rows <= cpu_linear.SMALL_BATCH_ROWS
        assert (cpu_linear._PACK in model[0].__dict__) == packed  # the kernel ran, or F.linear
    else:
        assert cpu_linear._PACK not in model[0].__dict__  # the weight in place: no copy
        if 0 < rows <= widen.ROWS:  # linear_rows ran: its very sums
            x2 = x.reshape(rows, 37)
            b = None if model[0].bias is None else model[0].bias.detach()
            with torch.no_grad():
                assert torch.equal(model[0](x2), _built().linear_rows(x2, model[0].weight, b))


def test_small_batch_kernel_is_chosen_where_it_runs():
    runs = _built().linear_best_isa() == "avx512"
    assert runs == _cpu_has_avx512()  # the extension's CPU check agrees with torch's
    assert ("avx512" in available_kernels()) == runs
    if runs:
        assert cpu_linear.choose_kernel() == "avx512"


def _small_batch_isas():
    """The ISAs to test: the plain loop everywhere, AVX-512 where the CPU has it."""
    return ["baseline"] + (["avx512"] if _cpu_has_avx512() else [])


# out features: 1, a panel less one, a panel, a panel and one, SmolLM2's k/v and up sizes;
# in features: 1, an odd count, more than one chunk of k (256), SmolLM2's down size; rows
# as above (24 and 25 are one and two AVX-512 groups; 49 rows are three groups of 16-17)
@pytest.mark.parametrize("isa", _small_batch_isas())
@pytest.mark.parametrize(
    "rows,out_features,in_features",
    [
        (1, 1, 1),
        (1, 15, 37),
        (7, 16, 300),
        (24, 17, 257),
        (25, 192, 576),
        (49, 33, 1536),
        (16, 1536, 576),
        (3, 5, 0),
        (0, 5, 7),
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_small_batch_kernel_matches_float64(isa, rows, out_features, in_features, bias):
    module = _built()
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    panels = module.pack_linear_weight(w)
    assert panels.shape == (-(-out_features // 16), in_features, 16)
    got = module.linear_small_batch(x, panels, b, out_features, isa)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    # float32 sums of in_features products: error ~ sqrt(K) ulps of the magnitudes involved
    tol = 1e-6 * (1 + in_features) * max(1.0, float(x.abs().max()) if x.numel() else 1.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=tol)


@pytest.mark.parametrize("isa", _small_batch_isas())
@pytest.mark.parametrize("rows", [1, 24, 25])
def test_small_batch_kernel_sums_in_blocks(isa, rows):
    """One product of 1, then 1535 products of 2**-25 (a quarter ulp of 1): a single running
    float32 sum rounds every one of them away (an error of 4.6e-5); summed in blocks of 64,
    only the first block's 63 are lost (1.9e-6). The same error, in large activations that
    cancel, made SmolLM2's log-probabilities on its special tokens 2.4x further from
    float64 than torch's layers; now closer than torch's."""
    module = _built()
    K = 1536  # SmolLM2's down projection
    x = torch.full((rows, K), 2.0**-13)
    x[:, 0] = 1.0
    w = torch.full((20, K), 2.0**-12)
    w[:, 0] = 1.0
    got = module.linear_small_batch(x, module.pack_linear_weight(w), None, 20, isa)
    want = 1 + (K - 1) * 2.0**-25
    assert float((got.double() - want).abs().max()) <= 63 * 2.0**-25 + 1e-9


def test_small_batch_kernel_isas_agree():
    """The AVX-512 kernel and the plain loop: the same sums in the same order of k (up to
    the rounding of fused multiply-adds)."""
    if not _cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512F")
    module = _built()
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(20, 700, generator=g), torch.randn(100, 700, generator=g)
    panels = module.pack_linear_weight(w)
    fast = module.linear_small_batch(x, panels, None, 100, "avx512")
    plain = module.linear_small_batch(x, panels, None, 100, "baseline")
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-4)
    assert torch.equal(module.linear_small_batch(x, panels, None, 100), fast)  # auto


def test_pack_linear_weight_keeps_16_bit_weights():
    """A bfloat16 weight (the fused decoder's, for a bfloat16 model) packs into the float32
    panels' values, in bfloat16, its k-steps in pairs (each feature's two values side by
    side); an odd number of input features cannot pair. A float16 one, unpaired."""
    module = _built()
    w = torch.randn(37, 12, generator=torch.Generator().manual_seed(3)).bfloat16()
    panels = module.pack_linear_weight(w)
    assert panels.dtype == torch.bfloat16 and panels.shape == (3, 12, 16)
    unpaired = panels.view(3, 6, 16, 2).transpose(2, 3).reshape(3, 12, 16)
    assert torch.equal(unpaired.float(), module.pack_linear_weight(w.float()))
    with pytest.raises(RuntimeError, match="even number of input features"):
        module.pack_linear_weight(w[:, :11].contiguous())
    half = w[:, :11].half()  # float16 does not pair: any number of input features
    panels = module.pack_linear_weight(half)
    assert panels.dtype == torch.float16 and panels.shape == (3, 11, 16)
    assert torch.equal(panels.float(), module.pack_linear_weight(half.float()))


def _panels_by_torch(w):
    """The panel layout spelled out in plain torch: rows padded to a multiple of 16, [P, 16, K]
    -> [P, K, 16]; bfloat16 with each feature's two k-steps side by side."""
    n, k = w.shape
    count = -(-n // 16)
    padded = torch.zeros(count * 16, k, dtype=w.dtype)
    padded[:n] = w
    panels = padded.view(count, 16, k).transpose(1, 2)
    if w.dtype == torch.bfloat16:
        panels = panels.reshape(count, k // 2, 2, 16).transpose(2, 3).reshape(count, k, 16)
    return panels.contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1, 2), (16, 4), (37, 12), (130, 66)])
def test_pack_linear_weight_lays_out_panels_in_place(dtype, n, k):
    """Packed alone, into a slice of a larger allocation, and into every other panel of one
    (how the fused decoder interleaves gate and up): each equals the layout built in plain
    torch, from a weight whose rows lie apart (a column slice)."""
    module = _built()
    g = torch.Generator().manual_seed(n * 100 + k)
    w = torch.randn(n, k + 6, generator=g).to(dtype)[:, 3 : 3 + k]
    want = _panels_by_torch(w)
    assert torch.equal(module.pack_linear_weight(w), want)
    count = want.shape[0]
    store = torch.full((2 * count + 1, k, 16), 7.0).to(dtype)
    module.pack_linear_weight(w, store[1 : 1 + count])
    assert torch.equal(store[1 : 1 + count], want)
    assert (store[0] == 7).all() and (store[1 + count :] == 7).all()  # nothing else written
    other = (w * 2).contiguous()
    module.pack_linear_weight(w, store[0 : 2 * count : 2])
    module.pack_linear_weight(other, store[1 : 2 * count : 2])
    assert torch.equal(store[0 : 2 * count : 2], want)
    assert torch.equal(store[1 : 2 * count : 2], _panels_by_torch(other))


def test_pack_linear_weight_rejects_a_wrong_out():
    module = _built()
    w = torch.randn(20, 8)
    with pytest.raises(RuntimeError, match=r"out must be a \[2, 8, 16\] Float"):
        module.pack_linear_weight(w, torch.empty(1, 8, 16))
    with pytest.raises(RuntimeError, match="out must be"):
        module.pack_linear_weight(w, torch.empty(2, 8, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="each panel of out must be contiguous"):
        module.pack_linear_weight(w, torch.empty(2, 16, 8).transpose(1, 2))


def test_small_batch_kernel_rejects_bad_input():
    module = _built()
    w = torch.randn(20, 8)
    panels = module.pack_linear_weight(w)
    x = torch.randn(3, 8)
    call = module.linear_small_batch
    with pytest.raises(RuntimeError, match="2-D"):
        module.pack_linear_weight(torch.randn(20))
    with pytest.raises(RuntimeError, match="float32"):
        module.pack_linear_weight(w.double())
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D float32"):
        call(x.double(), panels, None, 20)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D float32"):
        call(torch.randn(8, 3).t(), panels, None, 20)
    with pytest.raises(RuntimeError, match="x has 7 features, the packed weight 8"):
        call(torch.randn(3, 7), panels, None, 20)
    with pytest.raises(RuntimeError, match="panels must come from pack_linear_weight"):
        call(x, w, None, 20)
    with pytest.raises(RuntimeError, match="33 output features do not match 2 panels"):
        call(x, panels, None, 33)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 CPU vector of 20"):
        call(x, panels, torch.randn(19), 20)
    with pytest.raises(RuntimeError, match="unknown isa 'sse'"):
        call(x, panels, None, 20, "sse")
    if module.linear_best_isa() != "avx512":
        with pytest.raises(RuntimeError, match="cannot run the avx512 kernel"):
            call(x, panels, None, 20, "avx512")


def test_follows_weight_changes(kernel):
    layer = torch.nn.Linear(16, 24)
    pack_linear_layers(layer, kernel)
    x = torch.randn(4, 16)
    with torch.no_grad():
        layer(x)  # packs
        layer.weight.mul_(-2.0)  # in place: the version counter moves
        torch.testing.assert_close(
            layer(x).double(), float64_linear(layer, x), rtol=1e-5, atol=1e-5
        )
        layer.weight = torch.nn.Parameter(torch.randn(24, 16))  # replaced
        torch.testing.assert_close(
            layer(x).double(), float64_linear(layer, x), rtol=1e-5, atol=1e-5
        )


def test_follows_edits_behind_the_version_counter(kernel):
    """Edits through ``.data`` move neither the version counter nor (in place) the storage:
    peft's merge_adapter does ``weight.data += delta``. The sampled snapshot sees edits of
    the whole tensor; drop_packed_copies (what reload_weights does) covers the rest."""
    layer = torch.nn.Linear(40, 300)
    pack_linear_layers(layer, kernel)
    x = torch.randn(5, 40)

    def check():
        torch.testing.assert_close(
            layer(x).double(), float64_linear(layer, x), rtol=1e-5, atol=1e-5
        )

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
        if kernel == "avx512":  # a packed copy: the edit is not seen
            assert (layer(x) - float64_linear(layer, x).float()).abs().max() > 0.1
            cpu_linear.drop_packed_copies(layer)
        check()  # rows reads the weight itself: seen at once


def test_inference_mode_weights(kernel):
    """A model built under ``torch.inference_mode`` has inference-tensor weights, which have
    no version counter (reading ``_version`` raises): the packed path must still work, in and
    out of inference mode, and follow edits made under inference mode."""
    with torch.inference_mode():
        model = small_model()
    assert model[0].weight.is_inference()
    assert pack_linear_layers(model, kernel) == 2
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


def test_packed_model_copies_and_pickles(kernel):
    """A packed model is still the caller's model: copy.deepcopy and torch.save/torch.load
    work after it has run (no kernel's packed copy is carried over), and the copy is a packed
    model of its own,
    bound to its own weights."""
    import copy
    import io

    model = small_model()
    pack_linear_layers(model, kernel)
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


def test_converted_model_drops_its_stale_copies(kernel):
    """After model.to(bfloat16) the float32 packed copies (and the old float32 weights their
    snapshots keep alive: as much memory again as the model) are released by the first
    product in the new dtype, not held until a float32 product that may never come. A
    float32 input against a bfloat16 weight gets torch's own dtype error, not a kernel's."""
    model = small_model()
    pack_linear_layers(model, kernel)
    linears = [model[0], model[2]]
    x = torch.randn(3, 37)
    with torch.no_grad():
        model(x)  # packs (avx512; rows copies nothing)
        copies = kernel == "avx512"
        assert all((cpu_linear._PACK in m.__dict__) == copies for m in linears)
        model.to(torch.bfloat16)
        reference = small_model().to(torch.bfloat16)  # the same weights, never packed
        torch.testing.assert_close(model(x.bfloat16()), reference(x.bfloat16()), rtol=0, atol=0)
        assert not any(cpu_linear._PACK in m.__dict__ for m in linears)
        with pytest.raises(RuntimeError, match="dtype"):
            model[0](x)
        model.float()  # back: packs afresh, from the (rounded) float32 weights
        want = float64_linear(model[2], torch.tanh(float64_linear(model[0], x)).float())
        torch.testing.assert_close(model(x).double(), want, rtol=1e-5, atol=1e-5)
        assert all((cpu_linear._PACK in m.__dict__) == copies for m in linears)


def test_other_inputs_use_torch(kernel):
    layer = torch.nn.Linear(8, 3)
    pack_linear_layers(layer, kernel)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()  # autograd: F.linear, so gradients flow
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(2, 8))
    assert layer.weight.grad is not None
    with torch.no_grad():
        y = layer.double()(torch.randn(2, 8, dtype=torch.float64))
    assert y.dtype == torch.float64
    frozen = torch.nn.Linear(8, 3)  # a frozen weight and a trainable bias: still autograd
    frozen.weight.requires_grad_(False)
    pack_linear_layers(frozen, kernel)
    frozen(torch.randn(5, 8)).sum().backward()
    torch.testing.assert_close(frozen.bias.grad, torch.full((3,), 5.0))
    double = torch.nn.Linear(8, 3).double()
    assert pack_linear_layers(double, kernel) == 0  # only float32 layers are packed


def test_switch_and_undo():
    model = small_model()
    assert pack_linear_layers(model, "torch") == 0
    assert not any("forward" in m.__dict__ for m in model)
    with pytest.raises(ValueError, match="must be 'auto', 'avx512', 'rows' or 'torch'"):
        pack_linear_layers(model, "mkl")
    for kernel in cpu_linear.KERNELS:
        if kernel not in available_kernels():
            with pytest.raises(ValueError, match=f"{kernel}: that kernel does not run here"):
                pack_linear_layers(model, kernel)
            continue
        assert pack_linear_layers(model, kernel) == 2
        with torch.no_grad():
            model(torch.randn(2, 37))
        unpack_linear_layers(model)
        assert not any("forward" in m.__dict__ or cpu_linear._PACK in m.__dict__ for m in model)
    assert pack_linear_layers(model) == (2 if available_kernels() else 0)  # "auto"
    unpack_linear_layers(model)


@pytest.mark.slow
def test_smollm2_packed_and_given_back(kernel, monkeypatch):
    """The real model, on transformers' forward (the fused decoder, which has its own
    packed copies, is refused here): AsyncTransformer packs every linear layer, the packed
    forward agrees with torch's, and cleanup gives the caller's model its own layers
    back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genlm_fast.backend.llm import AsyncTransformer, model_state
    from genlm_fast.models import smollm2_path

    def refuse(model):
        raise model_state.Unsupported("refused for this test")

    monkeypatch.setattr(model_state, "FusedDecoder", refuse)

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([AutoTokenizer.from_pretrained(path).encode("The capital of France is")])
    with torch.no_grad():
        plain = model(ids).logits
    lm = AsyncTransformer(model, AutoTokenizer.from_pretrained(path), cpu_linear=kernel)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert lm._packed_linears == len(linears) > 200
    with torch.no_grad():
        packed = model(ids).logits
    torch.testing.assert_close(packed.log_softmax(-1), plain.log_softmax(-1), rtol=0, atol=5e-4)
    assert int(packed[0, -1].argmax()) == int(plain[0, -1].argmax())
    lm.cleanup()
    assert not any("forward" in m.__dict__ for m in linears)


def test_async_transformer_takes_the_kernel_as_an_argument():
    """``AsyncTransformer(cpu_linear=...)`` reaches `pack_linear_layers`: "torch" leaves the
    model's layers as they are, an unknown name is refused."""
    from transformers import AutoTokenizer

    from genlm_fast.backend.llm import AsyncTransformer
    from genlm_fast.models import smollm2_path
    from tests.backend.small_models import small_model

    tok = AutoTokenizer.from_pretrained(smollm2_path(quiet=True))
    model = small_model(len(tok), "llama").float().cpu()
    before = {name: type(m) for name, m in model.named_modules()}
    lm = AsyncTransformer(model, tok, cpu_linear="torch")
    assert lm._packed_linears == 0
    assert {name: type(m) for name, m in model.named_modules()} == before
    lm.cleanup()
    with pytest.raises(ValueError, match="CPU linear kernel must be"):
        AsyncTransformer(model, tok, cpu_linear="mkl")
