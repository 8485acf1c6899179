"""A Hugging Face causal LM's decoding forward in one compiled call, on the CPU.

transformers runs a forward pass of a small model over a few new tokens as a few hundred
torch ops per layer stack, most of them tiny (norms, rotations, reshapes, attention over a
short past, the key/value cache's copies); on the CPU they cost as much as the weights' own
products. `FusedDecoder` reads a model's architecture and weights once and runs the same
forward as one call into ``genlm_fast._C`` (``csrc/decoder_cpu.cpp``): one parallel region,
the projections on packed copies of the weights (q|k|v and gate|up packed together), the
past keys and values read where `AsyncTransformer`'s `KVTrie` keeps them and the new ones
written straight into the segments it will keep.

The packed copy is the weights' one resident copy: the pages of the model's weights mapped
from the checkpoint go back to the file as each is packed (`file_pages`), a tied embedding's
rows are read from the head's panels, and transformers' layers read the panels too where its
forward still runs (`panel_layers`, installed by `model_state.ModelState`).

`decoder_spec.describe` says whether a model is one the decoder knows: its `FAMILIES`, float32,
bfloat16 or float16 (the packed copies keep the model's dtype, so a 16-bit model streams half
the bytes; the arithmetic is float32 either way, the same as on the model's float32 copy), on
the CPU, no peft adapters, on a CPU with AVX-512F; anything else keeps transformers' own
forward (`AsyncTransformer.forward_path` says which runs). The architecture is read from the
modules themselves (`decoder_spec`) and the rotary embedding's cos and sin come from the
model's own rotary module on each forward, so that every rope variant transformers
implements is honoured. `engines.FusedEngine` runs it for `AsyncTransformer`, and
`model_state.ModelState` builds it again when the model's weights change.
"""

from __future__ import annotations

import math
import weakref

import torch

from genlm_fast.backend.llm.checks import check_finite_logits
from genlm_fast.backend.llm.decoder_spec import (
    FAMILIES,
    WEIGHT_DTYPES,
    Architecture,
    Unsupported,
    describe,
)
from genlm_fast.backend.llm.file_pages import release
from genlm_fast.backend.llm.memory import shortfall
from genlm_fast.backend.llm.packed_pages import Gathering, empty
from genlm_fast.backend.llm.panel_layers import PanelSlice
from genlm_fast.backend.llm.plan import Output, Row, row_ids

__all__ = [
    "FAMILIES",
    "FusedDecoder",
    "FusedEngine",
    "NoRoom",
    "Unsupported",
    "WEIGHT_DTYPES",
    "fused_available",
]


# model_type -> the transformers class it must be, and the norms' classes
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


def _pack_into(module, out, weights, interleave=False):
    """Pack weights [N_i, K] into ``out`` [P, K, 16] (`_panel_shape`): stacked, the panels of
    each following the last's, or, ``interleave``, two of them panel by panel. Each weight is
    packed straight into its panels (a copy of the concatenation only where a weight's rows
    do not end on a whole panel). Returns where each weight lies (`PanelSlice`)."""
    weights = [w.detach().to(out.dtype) for w in weights]  # (as they are, where they match)
    if interleave:
        slices = [PanelSlice(out[i::2], 0, int(w.shape[0])) for i, w in enumerate(weights)]
    else:
        slices, row = [], 0
        for w in weights:
            n = int(w.shape[0])
            slices.append(PanelSlice(out[row // 16 : -(-(row + n) // 16)], row % 16, n))
            row += n
    if any(where.start for where in slices):
        module.pack_linear_weight(torch.cat(weights), out)
    else:
        for w, where in zip(weights, slices):
            module.pack_linear_weight(w, where.panels)
    return slices


def _panel_shape(weights, interleave):
    """The shape of ``weights``' packed panels (`_pack_into`)."""
    k = int(weights[0].shape[1])
    if interleave:
        return (2 * -(-int(weights[0].shape[0]) // 16), k, 16)
    return (-(-sum(int(w.shape[0]) for w in weights) // 16), k, 16)


def _pack(arch: Architecture, module):
    """The DecoderCPU built from ``arch``'s weights, where each layer's weight lies in its
    panels [(module, PanelSlice)] (the linear layers', and a tied embedding's: the head's
    weight, whose rows the decoder reads from the head's panels too), and the tensor the
    panels live in. The model keeps its weights; the pages of them mapped from the checkpoint
    go back to the file as each is packed (`file_pages`)."""
    head = arch.linears["head"][0].weight
    arch.spec.embed_from_head = _same_elements(arch.embed, head)
    spec = arch.spec.copy_to(module.DecoderSpec())
    weights = {} if arch.spec.embed_from_head else {"embed": arch.embed.detach()}
    if arch.pos_embed is not None:
        weights["pos_embed"] = arch.pos_embed.detach()
    for name, (w, one_plus) in arch.vectors.items():
        w = w.detach().to(torch.float32)
        weights[name] = (1.0 + w) if one_plus else w.clone()
    # the packed panels live in one allocation: one mapping of its own that goes back to the
    # system whole when the decoder goes (separate tensors of a few MB each would come from
    # the C heap, which keeps what it cannot hand back in whole pages), gathered into 2 MB
    # pages once filled (`packed_pages`)
    shapes = {
        name: _panel_shape([p.weight for p in parts], name.endswith("up") and arch.spec.gated)
        for name, parts in arch.linears.items()
    }
    sizes = {name: -(-math.prod(shape) // 16) * 16 for name, shape in shapes.items()}
    store = empty(sum(sizes.values()), arch.embed.dtype)
    offset, layers = 0, []
    for name, parts in arch.linears.items():
        gated = name.endswith("up") and arch.spec.gated
        view = store[offset : offset + math.prod(shapes[name])].view(shapes[name])
        slices = _pack_into(module, view, [p.weight for p in parts], interleave=gated)
        layers.extend((p.module, where) for p, where in zip(parts, slices))
        if name == "head" and arch.spec.embed_from_head:
            layers.append((arch.embed_module, slices[0]))
        release([p.weight for p in parts])
        weights[name] = view
        offset += sizes[name]
        if any(p.bias is not None for p in parts):
            weights[name + "_b"] = torch.cat(
                [
                    p.bias.detach().to(torch.float32)
                    if p.bias is not None
                    else torch.zeros(p.weight.shape[0])
                    for p in parts
                ]
            ).contiguous()
    release([arch.embed, arch.pos_embed])  # (rows read per token come back as they are read)
    return module.DecoderCPU(spec, weights), layers, store


def _same_elements(a, b) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


class NoRoom(Unsupported):
    """The fused decoder's packed weights would not fit in memory (the message says how
    much they take and what the process may still take)."""


class FusedDecoder:
    """A model's decoding forward in one compiled call (module docstring).

    Args:
        model: A Hugging Face causal LM of a family in `FAMILIES`.

    Raises:
        Unsupported: the model is not one the decoder runs.
        NoRoom: its packed copy of the weights would not fit in the memory this process
            may still take (`memory.shortfall`).

    Attributes:
        panel_layers: ``[(module, PanelSlice)]``, where each packed layer's weight lies in
            the panels (`panel_layers.read_panels` makes transformers' layers read them).
        sources: the model's tensors the panels were made from (`file_pages.release`).
        huge_pages: the panels' gathering into 2 MB pages (`packed_pages.Gathering`), once
            `gather_huge_pages` started it.
    """

    def __init__(self, model):
        why = fused_available()
        if why:
            raise Unsupported(why)
        arch = describe(model)
        need = sum(
            p.weight.numel() * p.weight.element_size()
            for parts in arch.linears.values()
            for p in parts
        )
        short = shortfall(need, "the fused decoder's packed copy of the weights")
        if short is not None:
            raise NoRoom(short)
        module = _module()
        self.family = arch.family
        self.layers = arch.spec.layers
        self.kv_heads = arch.spec.kv_heads
        self.head_dim = arch.spec.head_dim
        self.max_positions = arch.spec.max_positions if arch.spec.learned_positions else None
        self._rotary = arch.rotary
        self._impl, self.panel_layers, self._panels = _pack(arch, module)
        self.huge_pages = None
        self.sources = [p.weight for parts in arch.linears.values() for p in parts]
        self.sources += [t for t in (arch.embed, arch.pos_embed) if t is not None]

    def gather_huge_pages(self) -> None:
        """Start gathering the panels into 2 MB pages on idle CPUs (`packed_pages`), once the
        loading's own page work is done (the gathering holds the process's memory map while
        it swaps a stretch: a page release beside it would wait). It stops with the decoder."""
        if self.huge_pages is None:
            self.huge_pages = Gathering(self._panels)
            weakref.finalize(self, self.huge_pages.stop)

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


class FusedEngine:
    """The `plan.Engine` of the fused decoder: the base model's forwards of up to
    ``max_tokens`` new tokens (all rows together) in one call of the `FusedDecoder` that
    ``state`` (`model_state.ModelState`) builds where the model allows it (and builds
    again when its weights change)."""

    name = "fused"
    MAX_TOKENS = 64

    def __init__(self, state):
        self.state = state
        self.max_tokens = self.MAX_TOKENS

    def why_not(self, row, lora):
        if self.state.decoder is None:
            return self.state.reason
        if lora is not None:
            return "an adapter is active"
        if row.new > self.max_tokens:
            return f"more than {self.max_tokens} new tokens"
        return None

    def pack(self, rows, chosen):
        """``chosen`` (indices of ``rows``) cut into forwards of at most ``max_tokens`` new
        tokens, in order."""
        chunks, chunk, size = [], [], 0
        for i in chosen:
            n = rows[i].new
            if size + n > self.max_tokens:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(i)
            size += n
        if chunk:
            chunks.append(chunk)
        return chunks

    def run(self, rows, keep):
        logits, segments = self.state.decoder.forward(rows)
        check_finite_logits(logits, row_ids(rows))
        return Output(logits, segments if keep else None)

    def uncached(self, ids):
        """The last position's logits [V] of ``ids`` run from scratch."""
        return self.state.decoder.forward([Row(tuple(ids), 0, [])])[0][0]
