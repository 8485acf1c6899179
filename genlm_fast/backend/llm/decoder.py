"""A Hugging Face causal LM's decoding forward in one compiled call, on the CPU.

transformers runs a forward pass of a small model over a few new tokens as a few hundred
torch ops per layer stack, most of them tiny (norms, rotations, reshapes, attention over a
short past, the key/value cache's copies); on the CPU they cost as much as the weights' own
products. `FusedDecoder` reads a model's architecture and weights once and runs the same
forward as one call into ``genlm_fast._C`` (``csrc/decoder_cpu.cpp``): one parallel region,
the projections on packed copies of the weights (q|k|v and gate|up packed together), the
past keys and values read where `AsyncTransformer`'s `KVTrie` keeps them and the new ones
written straight into the segments it will keep.

`describe` says whether a model is one the decoder knows: the families below, float32,
bfloat16 or float16 (the packed copies keep the model's dtype, so a 16-bit model streams half
the bytes; the arithmetic is float32 either way, the same as on the model's float32 copy), on
the CPU, no peft adapters, on a CPU with AVX-512F; anything else keeps transformers' own
forward (`AsyncTransformer.forward_path` says which runs). The architecture is read from the
modules themselves (each norm's epsilon, each attention's scaling and sliding window, the
MLP's activation, biases, a scaled or tied embedding) and the rotary embedding's cos and sin
come from the model's own rotary module on each forward, so that every rope variant
transformers implements is honoured.

`ModelWatch` is how `AsyncTransformer` notices a model changing under it (a parameter
replaced or edited, an adapter injected): its packed copies and cached keys and values are
then rebuilt.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch

__all__ = [
    "FAMILIES",
    "FusedDecoder",
    "ModelWatch",
    "Unsupported",
    "WEIGHT_DTYPES",
    "describe",
    "fused_available",
    "huge_page_empty",
]

# model_type -> the transformers class it must be, and the norms' classes
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


def _module():
    from genlm_fast.ops import extension

    module = extension.load_module()
    if module is None or not hasattr(module, "DecoderCPU"):
        return None
    return module


def fused_available() -> str | None:
    """None when the fused decoder runs on this machine, else why not."""
    module = _module()
    if module is None:
        return "genlm_fast._C is not built (or predates the fused decoder)"
    if not module.decoder_supported():
        return "this CPU lacks AVX-512F"
    return None


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
class _Arch:
    family: str
    spec: dict
    vectors: dict = field(default_factory=dict)  # name -> tensor to copy as is
    linears: dict = field(default_factory=dict)  # name -> [(weight [N, K], bias or None)]
    embed: torch.Tensor | None = None
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
    return w, module.bias


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


def describe(model) -> _Arch:
    """The architecture and weights of ``model`` as the fused decoder needs them.

    Raises:
        Unsupported: the model is not one the fused decoder runs (the message says why).
    """
    why = fused_available()
    if why:
        raise Unsupported(why)
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
    head_w, head_b = _linear(head, "lm_head", in_features=H)
    spec = {
        "layers": len(layers),
        "hidden": H,
        "heads": nh,
        "kv_heads": nkv,
        "head_dim": hd,
        "vocab": vocab,
        "layer_norm": False,
        "qk_norm": family == "qwen3",
        "post_norms": family == "gemma2",
        "learned_positions": False,
        "attn_softcap": float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        "final_softcap": float(getattr(config, "final_logit_softcapping", None) or 0.0),
        "embed_scale": 1.0,
        "scaling": [],
        "window": [],
    }
    if hasattr(embed, "embed_scale"):
        spec["embed_scale"] = float(embed.embed_scale.to(torch.float32))
    arch = _Arch(
        family, spec, embed=read.param(embed, "weight"), rotary=read.module(base, "rotary_emb")
    )
    one_plus = family in _ONE_PLUS_WEIGHT

    def norm(module, name, dim=H):
        if _kind(module) != norm_cls:
            raise Unsupported(f"{name} is a {_kind(module)}, not a {norm_cls}")
        w = read.param(module, "weight")
        if w.shape != (dim,):
            raise Unsupported(f"{name} has shape {tuple(w.shape)}")
        eps = _norm_eps(module)
        if spec.setdefault("eps", eps) != eps:
            raise Unsupported("its norms have different epsilons")
        arch.vectors[name] = (w, one_plus)

    norm(read.module(base, "norm"), "final_norm")
    arch.linears["head"] = [(head_w, head_b)]
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
        inter = gate[0].shape[0]
        spec.setdefault("inter", inter)
        if inter != spec["inter"]:
            raise Unsupported("its layers have different MLP sizes")
        arch.linears[p + "up"] = [gate, _linear(read.module(mlp, "up_proj"), "up_proj", inter, H)]
        arch.linears[p + "down"] = [_linear(read.module(mlp, "down_proj"), "down_proj", H, inter)]
        act = _activation(read.module(mlp, "act_fn"))
        if spec.setdefault("act", act) != act:
            raise Unsupported("its layers have different activations")
        spec["scaling"].append(float(attn.scaling))
        if family == "mistral":
            window = getattr(config, "sliding_window", None)
        else:
            window = getattr(attn, "sliding_window", None)
        spec["window"].append(int(window or 0))
        cap = getattr(attn, "attn_logit_softcapping", None)
        if float(cap or 0.0) != spec["attn_softcap"]:
            raise Unsupported("its attention soft caps differ from the config's")
    spec["gated"] = True
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
    head_w, head_b = _linear(head, "lm_head", in_features=H)
    spec = {
        "layers": len(blocks),
        "hidden": H,
        "heads": nh,
        "kv_heads": nh,
        "head_dim": hd,
        "vocab": int(head_w.shape[0]),
        "layer_norm": True,
        "qk_norm": False,
        "post_norms": False,
        "learned_positions": True,
        "max_positions": int(wpe.weight.shape[0]),
        "attn_softcap": 0.0,
        "final_softcap": 0.0,
        "embed_scale": 1.0,
        "gated": False,
        "scaling": [],
        "window": [],
    }
    arch = _Arch("gpt2", spec, embed=read.param(wte, "weight"), pos_embed=read.param(wpe, "weight"))

    def norm(module, name):
        if _kind(module) != norm_cls or not getattr(module, "elementwise_affine", True):
            raise Unsupported(f"{name} is not an affine LayerNorm")
        eps = float(module.eps)
        if spec.setdefault("eps", eps) != eps:
            raise Unsupported("its norms have different epsilons")
        arch.vectors[name] = (read.param(module, "weight"), False)
        arch.vectors[name + "_b"] = (read.param(module, "bias"), False)

    def conv1d(module, what, n, k):
        if _kind(module) != "Conv1D":
            raise Unsupported(f"{what} is a {_kind(module)}, not a Conv1D")
        w, b = read.param(module, "weight"), read.param(module, "bias", optional=True)
        if w.shape != (k, n):
            raise Unsupported(f"{what} has shape {tuple(w.shape)}")
        return w.t(), b  # as a Linear's [out, in]

    norm(read.module(base, "ln_f"), "final_norm")
    arch.linears["head"] = [(head_w, head_b)]
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
        spec.setdefault("inter", inter)
        if inter != spec["inter"]:
            raise Unsupported("its layers have different MLP sizes")
        arch.linears[p + "up"] = [conv1d(fc, "c_fc", inter, H)]
        arch.linears[p + "down"] = [conv1d(read.module(mlp, "c_proj"), "mlp.c_proj", H, inter)]
        act = _activation(read.module(mlp, "act"))
        if spec.setdefault("act", act) != act:
            raise Unsupported("its layers have different activations")
        spec["scaling"].append(float(attn.scaling))
        spec["window"].append(0)
    return arch


def _panels(module, weights, interleave=False):
    """Weights [N_i, K] stacked (or, ``interleave``, two of them panel by panel) as packed
    panels [P, K, 16]."""
    if interleave:
        a, b = (module.pack_linear_weight(w.detach().contiguous()) for w in weights)
        return torch.stack((a, b), dim=1).reshape(-1, a.shape[1], a.shape[2]).contiguous()
    w = weights[0] if len(weights) == 1 else torch.cat(weights)
    return module.pack_linear_weight(w.detach().contiguous())


def _panel_shape(weights, interleave):
    """The shape `_panels` gives ``weights``."""
    k = int(weights[0].shape[1])
    if interleave:
        return (2 * -(-int(weights[0].shape[0]) // 16), k, 16)
    return (-(-sum(int(w.shape[0]) for w in weights) // 16), k, 16)


def huge_page_empty(numel, dtype=torch.float32):
    """A CPU tensor of ``numel`` zeros of ``dtype`` in a mapping of its own, backed by 2 MB pages
    where the kernel allows it (Linux transparent huge pages, on request), unmapped when the
    tensor goes.

    A forward streams every packed weight once; on 4 KB pages each 4 KB of it is one more
    TLB miss and a point where prefetching stops, which huge pages avoid. Where the kernel
    has huge pages off (or no madvise), this is an ordinary zeroed mapping.
    """
    if numel == 0:
        return torch.zeros(0, dtype=dtype)
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:  # huge pages unsupported: small pages it is
            pass
    # (the tensor keeps the mapping alive; it is unmapped when the tensor is freed)
    return torch.frombuffer(buf, dtype=dtype, count=numel)


def _pack(arch: _Arch, module):
    """The DecoderCPU built from ``arch``'s weights (copied: the model keeps its own)."""
    spec = module.DecoderSpec()
    for key, value in arch.spec.items():
        setattr(spec, key, value)
    weights = {"embed": arch.embed.detach()}
    if arch.pos_embed is not None:
        weights["pos_embed"] = arch.pos_embed.detach()
    for name, (w, one_plus) in arch.vectors.items():
        w = w.detach().to(torch.float32)
        weights[name] = (1.0 + w) if one_plus else w.clone()
    # the packed panels live in one allocation: one mapping of its own that goes back to the
    # system whole when the decoder goes (separate tensors of a few MB each would come from
    # the C heap, which keeps what it cannot hand back in whole pages), in huge pages
    shapes = {
        name: _panel_shape([w for w, _ in parts], name.endswith("up") and arch.spec["gated"])
        for name, parts in arch.linears.items()
    }
    sizes = {name: -(-math.prod(shape) // 16) * 16 for name, shape in shapes.items()}
    store = huge_page_empty(sum(sizes.values()), arch.embed.dtype)
    offset = 0
    for name, parts in arch.linears.items():
        gated = name.endswith("up") and arch.spec["gated"]
        view = store[offset : offset + math.prod(shapes[name])].view(shapes[name])
        view.copy_(_panels(module, [w for w, _ in parts], interleave=gated))
        weights[name] = view
        offset += sizes[name]
        biases = [b for _, b in parts]
        if any(b is not None for b in biases):
            weights[name + "_b"] = torch.cat(
                [
                    b.detach().to(torch.float32) if b is not None else torch.zeros(w.shape[0])
                    for (w, _), b in zip(parts, biases)
                ]
            ).contiguous()
    return module.DecoderCPU(spec, weights)


class FusedDecoder:
    """A model's decoding forward in one compiled call (module docstring).

    Args:
        model: A Hugging Face causal LM of a family in `FAMILIES`.

    Raises:
        Unsupported: the model is not one the decoder runs.
    """

    def __init__(self, model):
        arch = describe(model)
        module = _module()
        self.family = arch.family
        self.layers = arch.spec["layers"]
        self.kv_heads = arch.spec["kv_heads"]
        self.head_dim = arch.spec["head_dim"]
        self.max_positions = (
            arch.spec.get("max_positions") if arch.spec["learned_positions"] else None
        )
        self._rotary = arch.rotary
        self._impl = _pack(arch, module)

    @property
    def weight_bytes(self) -> int:
        """Bytes of packed weights a forward streams."""
        return self._impl.weight_bytes

    def forward(self, plans):
        """One forward over ``plans`` [(ids, past length, past runs)]: the logits of each row's
        last token [B, V] and each row's new key/value segment [layers, 2, kv_heads, new,
        head_dim] (for the KV trie)."""
        tokens, positions, row_start, runs, run_start, segments = [], [], [0], [], [0], []
        keep = []  # copies made for the call (see _strided_positions)
        for ids, d, past in plans:
            n = len(ids) - d
            tokens.extend(ids[d:])
            positions.extend(range(d, d + n))
            row_start.append(len(tokens))
            seg = torch.empty((self.layers, 2, self.kv_heads, n, self.head_dim))
            segments.append(seg)
            for s, a, b in past:
                data = _strided_positions(s.data, keep)
                runs.append((data.data_ptr(), data.stride(2) // self.head_dim, a, b))
            runs.append((seg.data_ptr(), n, 0, n))
            run_start.append(len(runs))
        pos = torch.tensor(positions, dtype=torch.int64)
        if self._rotary is not None:
            cos, sin = self._rotary(torch.empty(0), pos[None])
            cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        else:
            cos = sin = torch.empty(0)
        logits = self._impl.forward(
            torch.tensor(tokens, dtype=torch.int64),
            pos,
            torch.tensor(row_start, dtype=torch.int64),
            cos,
            sin,
            torch.tensor(runs, dtype=torch.int64).reshape(-1, 4),
            torch.tensor(run_start, dtype=torch.int64),
        )
        return logits, segments


def _strided_positions(data, keep):
    """``data`` [layers, 2, kv_heads, positions, head_dim] as the kernel reads a run: each
    (layer, k/v, head) a block of positions ``stride(2)`` elements apart from the next, the
    blocks in order (a contiguous segment, or one slot of the KV trie's pool of one-position
    segments); anything else is copied first (into ``keep``, alive for the call)."""
    s0, s1, s2, s3, s4 = data.stride()
    if not (
        s4 == 1
        and s3 == data.shape[4]
        and s1 == data.shape[2] * s2
        and s0 == 2 * s1
        and data.dtype == torch.float32
    ):
        data = data.float().contiguous()
        keep.append(data)
    return data


class ModelWatch:
    """Whether a model still is what it was when the watch was made: the same submodules and
    parameters in place (none replaced, no adapter injected) and the parameters' contents
    unchanged. `genlm_fast._C.WeightWatch` checks both in one call; without the compiled
    extension the same checks run in Python, several times slower."""

    def __init__(self, model):
        # every dict of the model's structure, with the (name, object) items it held
        self._dicts = []
        for m in model.modules():
            self._dicts.append((m._modules, list(m._modules.items())))
            self._dicts.append((m._parameters, list(m._parameters.items())))
        params = {}
        for _, items in self._dicts[1::2]:
            for _, p in items:
                if p is not None:
                    params[id(p)] = p
        self._tensors = list(params.values())
        module = _module()
        self._impl = module.WeightWatch(self._tensors, self._dicts) if module is not None else None
        self._versions = (
            None
            if self._impl is not None
            else [(p.data_ptr(), p.dtype, _version(p), _sample(p)) for p in self._tensors]
        )

    def changed(self) -> bool:
        if self._impl is not None:
            return self._impl.changed() >= 0
        for d, items in self._dicts:
            if len(d) != len(items) or any(d.get(name) is not obj for name, obj in items):
                return True
        for p, (data, dtype, version, (at, bits)) in zip(self._tensors, self._versions):
            if (p.data_ptr(), p.dtype, _version(p)) != (data, dtype, version):
                return True
            if at is not None and not torch.equal(_bits(p.detach().reshape(-1)[at]), bits):
                return True
        return False


def _bits(t):
    """``t``'s elements as integers of their size, so that equal bits compare equal (NaN too)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.element_size() in ints else t


def _sample(p):
    """The entries ModelWatch compares (as WeightWatch does: all of a tensor of up to 4096,
    else 8 evenly spaced) and their bits, or (None, None) for an empty tensor or one off the
    CPU: reading a GPU tensor's entries back waits for the device, a wait per parameter and
    forward (its pointer and version are still checked)."""
    n = p.numel()
    if n == 0 or p.device.type != "cpu":
        return None, None
    at = torch.arange(0, n, 1 if n <= 4096 else n // 8, device=p.device)
    return at, _bits(p.detach().reshape(-1)[at]).clone()


def _version(p):
    try:
        return p._version
    except RuntimeError:  # an inference tensor has none
        return None
