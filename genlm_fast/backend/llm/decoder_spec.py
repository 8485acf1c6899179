"""A Hugging Face causal LM's architecture as the fused CPU decoder needs it.

`describe` reads a model's modules (each norm's epsilon, each attention's scaling and sliding
window, the MLP's activation, biases, a scaled or tied embedding) into an `Architecture`: a
typed `DecoderSpec`, the one description of what the compiled decoder computes (copied field
by field onto ``genlm_fast._C.DecoderSpec``, ``csrc/decoder_cpu.h``), and the weights it packs.
A model it does not know raises `Unsupported`, saying why; `genlm_fast.backend.llm.decoder`
packs and runs what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch

__all__ = [
    "FAMILIES",
    "Architecture",
    "DecoderSpec",
    "LinearPart",
    "Unsupported",
    "WEIGHT_DTYPES",
    "describe",
]

FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaRMSNorm"),
    "mistral": ("MistralForCausalLM", "MistralRMSNorm"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2RMSNorm"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3RMSNorm"),
    "gemma": ("GemmaForCausalLM", "GemmaRMSNorm"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2RMSNorm"),
    "gpt2": ("GPT2LMHeadModel", "LayerNorm"),
}
_ONE_PLUS_WEIGHT = {"gemma", "gemma2"}  # RMSNorm scales by (1 + weight)
_EMBEDDINGS = {"Embedding", "GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding"}
# transformers' activation modules by what they compute
_ACTIVATIONS = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "GELUActivation": "gelu_erf",
    "GELU": "gelu_erf",
    "ReLU": "relu",
}


# the weight dtypes the decoder streams (the arithmetic is float32 for each)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Unsupported(Exception):
    """The model is not one the fused decoder runs; the message says why."""


class _Reader:
    """Reads submodules and parameters by attribute path, remembering every step, so that
    `ModelWatch` can later tell whether the same objects are still in place."""

    def __init__(self, root):
        self.root = root

    def module(self, owner, path):
        for name in path.split("."):
            child = owner._modules.get(name) if isinstance(owner, torch.nn.Module) else None
            if child is None:
                raise Unsupported(f"{type(owner).__name__} has no submodule {name!r}")
            owner = child
        return owner

    @staticmethod
    def param(module, name, optional=False):
        p = module._parameters.get(name)
        if p is None and not optional:
            raise Unsupported(f"{type(module).__name__} has no parameter {name!r}")
        return p


@dataclass
class DecoderSpec:
    """What the fused decoder computes besides its weights (``csrc/decoder_cpu.h``'s
    ``DecoderSpec``, field for field; `copy_to` sets the compiled one).

    ``eps``, ``inter`` and ``act`` are None until the first norm, MLP and activation are
    read (`agree`); every later one must match them."""

    layers: int  # decoder layers
    hidden: int  # the residual stream's width
    heads: int  # query heads
    kv_heads: int  # key/value heads (fewer than ``heads``: grouped-query attention)
    head_dim: int
    vocab: int  # rows of the LM head
    layer_norm: bool  # LayerNorm (weight and bias), else RMSNorm (weight)
    qk_norm: bool  # RMSNorm over each query and key head before the rotation (Qwen3)
    post_norms: bool  # norms of the attention and MLP outputs before the residual (Gemma2)
    learned_positions: bool  # a position table added to the embedding, no rotation (GPT-2)
    attn_softcap: float  # 0: none, else scores = cap * tanh(scores / cap)
    final_softcap: float  # likewise for the logits
    embed_scale: float  # the embedding's factor (Gemma's sqrt(hidden))
    embed_from_head: bool = False  # the embedding is the head's weight: read from its panels
    gated: bool = True  # act(gate) * up, else act(fc)
    max_positions: int = 0  # rows of the learned position table (``learned_positions``)
    eps: float | None = None  # the norms' epsilon
    inter: int | None = None  # the MLP's width
    act: str | None = None  # silu, gelu_tanh, gelu_erf or relu
    scaling: list[float] = field(default_factory=list)  # per layer: the scores' factor
    window: list[int] = field(default_factory=list)  # per layer: sliding window (0: none)

    def agree(self, name, value) -> bool:
        """Set field ``name`` to ``value`` if unset; whether it (now) holds ``value``."""
        if getattr(self, name) is None:
            setattr(self, name, value)
        return getattr(self, name) == value

    def copy_to(self, compiled):
        """Set the fields of ``compiled`` (``genlm_fast._C.DecoderSpec``) from this one
        (unset ones keep the compiled defaults)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                setattr(compiled, f.name, value)
        return compiled


class LinearPart(NamedTuple):
    """One transformers layer's share of a packed product."""

    weight: torch.Tensor  # [N, K] (a Conv1D's [K, N] weight seen transposed)
    bias: torch.Tensor | None
    module: torch.nn.Module  # the nn.Linear or Conv1D that computes it in transformers' forward


@dataclass
class Architecture:
    """A model as the fused decoder runs it: its `DecoderSpec` and the weights to pack
    (the model's own tensors, copied only when packed)."""

    family: str  # a key of FAMILIES
    spec: DecoderSpec
    vectors: dict = field(default_factory=dict)  # name -> (tensor, scaled by 1 + weight)
    linears: dict = field(default_factory=dict)  # name -> [LinearPart], packed together
    embed: torch.Tensor | None = None
    embed_module: torch.nn.Module | None = None  # the nn.Embedding (or subclass) holding it
    pos_embed: torch.Tensor | None = None
    rotary: torch.nn.Module | None = None


def _kind(obj):
    return type(obj).__name__


def _linear(module, what, out_features=None, in_features=None):
    if type(module) is not torch.nn.Linear:
        raise Unsupported(f"{what} is a {_kind(module)}, not a torch.nn.Linear")
    w = module.weight
    if (out_features is not None and w.shape[0] != out_features) or (
        in_features is not None and w.shape[1] != in_features
    ):
        raise Unsupported(f"{what} has shape {tuple(w.shape)}")
    return LinearPart(w, module.bias, module)


def _norm_eps(norm):
    for name in ("variance_epsilon", "eps"):
        eps = getattr(norm, name, None)
        if isinstance(eps, (int, float)):
            return float(eps)
    raise Unsupported(f"{_kind(norm)} has no epsilon")


def _activation(act):
    kind = _ACTIVATIONS.get(_kind(act))
    if kind is None:
        raise Unsupported(f"activation {_kind(act)} is not one the fused decoder computes")
    if _kind(act) == "GELU" and getattr(act, "approximate", "none") == "tanh":
        kind = "gelu_tanh"
    return kind


def describe(model) -> Architecture:
    """The architecture and weights of ``model`` as the fused decoder needs them (whether
    this machine runs the decoder at all is `decoder.fused_available`'s to say).

    Raises:
        Unsupported: the model is not one the fused decoder runs (the message says why).
    """
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise Unsupported(
            f"architecture {family or _kind(model)!r} is not one the fused decoder "
            f"knows ({', '.join(FAMILIES)})"
        )
    cls, norm_cls = FAMILIES[family]
    if _kind(model) != cls:
        raise Unsupported(f"{_kind(model)} is not {cls}")
    if getattr(model, "_hf_peft_config_loaded", False):
        raise Unsupported("peft adapters are loaded")
    dtypes = set()
    for p in model.parameters():
        if p.dtype not in WEIGHT_DTYPES or p.device.type != "cpu":
            raise Unsupported(
                f"its weights are {p.dtype} on {p.device}, not float32, bfloat16 or float16 on "
                "the CPU"
            )
        dtypes.add(p.dtype)
    if len(dtypes) > 1:
        raise Unsupported(f"its weights mix {sorted(str(d) for d in dtypes)}")
    if model.training:
        raise Unsupported("the model is in training mode")
    read = _Reader(model)
    if family == "gpt2":
        arch = _describe_gpt2(model, config, read, norm_cls)
    else:
        arch = _describe_llama_like(model, config, read, family, norm_cls)
    if dtypes == {torch.bfloat16}:  # bfloat16 panels pair their k-steps
        for name, parts in arch.linears.items():
            if parts[0][0].shape[1] % 2:
                raise Unsupported(f"bfloat16 weights with an odd number of input features ({name})")
    return arch


def _describe_llama_like(model, config, read, family, norm_cls):
    base = read.module(model, "model")
    layers = read.module(base, "layers")
    embed = read.module(base, "embed_tokens")
    if _kind(embed) not in _EMBEDDINGS:
        raise Unsupported(f"the embedding is a {_kind(embed)}")
    head = read.module(model, "lm_head")
    H = int(config.hidden_size)
    nh, nkv = int(config.num_attention_heads), int(config.num_key_value_heads)
    attn0 = read.module(layers, "0.self_attn")
    hd = int(attn0.head_dim)
    vocab = int(head.weight.shape[0])
    head_part = _linear(head, "lm_head", in_features=H)
    spec = DecoderSpec(
        layers=len(layers),
        hidden=H,
        heads=nh,
        kv_heads=nkv,
        head_dim=hd,
        vocab=vocab,
        layer_norm=False,
        qk_norm=family == "qwen3",
        post_norms=family == "gemma2",
        learned_positions=False,
        attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        embed_scale=1.0,
        scaling=[],
        window=[],
    )
    if hasattr(embed, "embed_scale"):
        spec.embed_scale = float(embed.embed_scale.to(torch.float32))
    arch = Architecture(
        family,
        spec,
        embed=read.param(embed, "weight"),
        embed_module=embed,
        rotary=read.module(base, "rotary_emb"),
    )
    one_plus = family in _ONE_PLUS_WEIGHT

    def norm(module, name, dim=H):
        if _kind(module) != norm_cls:
            raise Unsupported(f"{name} is a {_kind(module)}, not a {norm_cls}")
        w = read.param(module, "weight")
        if w.shape != (dim,):
            raise Unsupported(f"{name} has shape {tuple(w.shape)}")
        eps = _norm_eps(module)
        if not spec.agree("eps", eps):
            raise Unsupported("its norms have different epsilons")
        arch.vectors[name] = (w, one_plus)

    norm(read.module(base, "norm"), "final_norm")
    arch.linears["head"] = [head_part]
    for i, layer in enumerate(layers):
        p = f"{i}."
        attn, mlp = read.module(layer, "self_attn"), read.module(layer, "mlp")
        if not getattr(attn, "is_causal", True):
            raise Unsupported("its attention is not causal")
        if int(attn.head_dim) != hd:
            raise Unsupported("its layers have different head sizes")
        norm(read.module(layer, "input_layernorm"), p + "norm1")
        if family == "gemma2":
            norm(read.module(layer, "post_attention_layernorm"), p + "post1")
            norm(read.module(layer, "pre_feedforward_layernorm"), p + "norm2")
            norm(read.module(layer, "post_feedforward_layernorm"), p + "post2")
        else:
            norm(read.module(layer, "post_attention_layernorm"), p + "norm2")
        if family == "qwen3":
            norm(read.module(attn, "q_norm"), p + "q_norm", hd)
            norm(read.module(attn, "k_norm"), p + "k_norm", hd)
        arch.linears[p + "qkv"] = [
            _linear(read.module(attn, "q_proj"), "q_proj", nh * hd, H),
            _linear(read.module(attn, "k_proj"), "k_proj", nkv * hd, H),
            _linear(read.module(attn, "v_proj"), "v_proj", nkv * hd, H),
        ]
        arch.linears[p + "o"] = [_linear(read.module(attn, "o_proj"), "o_proj", H, nh * hd)]
        gate = _linear(read.module(mlp, "gate_proj"), "gate_proj", in_features=H)
        inter = gate.weight.shape[0]
        if not spec.agree("inter", inter):
            raise Unsupported("its layers have different MLP sizes")
        arch.linears[p + "up"] = [gate, _linear(read.module(mlp, "up_proj"), "up_proj", inter, H)]
        arch.linears[p + "down"] = [_linear(read.module(mlp, "down_proj"), "down_proj", H, inter)]
        act = _activation(read.module(mlp, "act_fn"))
        if not spec.agree("act", act):
            raise Unsupported("its layers have different activations")
        spec.scaling.append(float(attn.scaling))
        if family == "mistral":
            window = getattr(config, "sliding_window", None)
        else:
            window = getattr(attn, "sliding_window", None)
        spec.window.append(int(window or 0))
        cap = getattr(attn, "attn_logit_softcapping", None)
        if float(cap or 0.0) != spec.attn_softcap:
            raise Unsupported("its attention soft caps differ from the config's")
    return arch


def _describe_gpt2(model, config, read, norm_cls):
    base = read.module(model, "transformer")
    blocks = read.module(base, "h")
    wte, wpe = read.module(base, "wte"), read.module(base, "wpe")
    head = read.module(model, "lm_head")
    if getattr(config, "add_cross_attention", False):
        raise Unsupported("it has cross-attention")
    H = int(config.hidden_size)
    nh = int(config.num_attention_heads)
    hd = H // nh
    head_part = _linear(head, "lm_head", in_features=H)
    spec = DecoderSpec(
        layers=len(blocks),
        hidden=H,
        heads=nh,
        kv_heads=nh,
        head_dim=hd,
        vocab=int(head_part.weight.shape[0]),
        layer_norm=True,
        qk_norm=False,
        post_norms=False,
        learned_positions=True,
        max_positions=int(wpe.weight.shape[0]),
        attn_softcap=0.0,
        final_softcap=0.0,
        embed_scale=1.0,
        gated=False,
        scaling=[],
        window=[],
    )
    arch = Architecture(
        "gpt2",
        spec,
        embed=read.param(wte, "weight"),
        embed_module=wte,
        pos_embed=read.param(wpe, "weight"),
    )

    def norm(module, name):
        if _kind(module) != norm_cls or not getattr(module, "elementwise_affine", True):
            raise Unsupported(f"{name} is not an affine LayerNorm")
        eps = float(module.eps)
        if not spec.agree("eps", eps):
            raise Unsupported("its norms have different epsilons")
        arch.vectors[name] = (read.param(module, "weight"), False)
        arch.vectors[name + "_b"] = (read.param(module, "bias"), False)

    def conv1d(module, what, n, k):
        if _kind(module) != "Conv1D":
            raise Unsupported(f"{what} is a {_kind(module)}, not a Conv1D")
        w, b = read.param(module, "weight"), read.param(module, "bias", optional=True)
        if w.shape != (k, n):
            raise Unsupported(f"{what} has shape {tuple(w.shape)}")
        return LinearPart(w.t(), b, module)  # as a Linear's [out, in]

    norm(read.module(base, "ln_f"), "final_norm")
    arch.linears["head"] = [head_part]
    for i, block in enumerate(blocks):
        p = f"{i}."
        attn, mlp = read.module(block, "attn"), read.module(block, "mlp")
        if not getattr(attn, "is_causal", True):
            raise Unsupported("its attention is not causal")
        norm(read.module(block, "ln_1"), p + "norm1")
        norm(read.module(block, "ln_2"), p + "norm2")
        arch.linears[p + "qkv"] = [conv1d(read.module(attn, "c_attn"), "c_attn", 3 * H, H)]
        arch.linears[p + "o"] = [conv1d(read.module(attn, "c_proj"), "attn.c_proj", H, H)]
        fc = read.module(mlp, "c_fc")
        inter = int(fc.weight.shape[1])
        if not spec.agree("inter", inter):
            raise Unsupported("its layers have different MLP sizes")
        arch.linears[p + "up"] = [conv1d(fc, "c_fc", inter, H)]
        arch.linears[p + "down"] = [conv1d(read.module(mlp, "c_proj"), "mlp.c_proj", H, inter)]
        act = _activation(read.module(mlp, "act"))
        if not spec.agree("act", act):
            raise Unsupported("its layers have different activations")
        spec.scaling.append(float(attn.scaling))
        spec.window.append(0)
    return arch
