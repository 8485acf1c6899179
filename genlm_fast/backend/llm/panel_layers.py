"""transformers' layers computing from the fused decoder's packed panels.

The fused decoder packs every linear layer of the model into panels (`decoder.FusedDecoder`)
and gives the pages of the weights it packed from back to their checkpoint file
(`file_pages.release`), so that the model is resident once. transformers' own forward still
runs where the fused one does not (a prompt longer than the fused forward takes, a forward
with an adapter over the base layers): were its layers to read their weights, every page would
come back. `read_panels` gives each packed layer a forward that reads its panels instead:

* a linear layer (``nn.Linear``, GPT-2's ``Conv1D``): ``x @ W^T + b`` in float32 (the
  contract of `widen`: the same arithmetic as the fused decoder's) with
  ``genlm_fast._C.linear_small_batch`` on the panels as they are, the fused decoder's own
  kernel; a prompt's rows in blocks of `ROW_BLOCK`, so that a block stays in L2 while the
  panels stream past (the panels are read once per block: a small cost beside the block's
  multiply-adds);
* an embedding tied to the LM head (the head's weight): each token's row is gathered from the
  head's panels (a column of one panel), in the weight's dtype as ``nn.Embedding`` returns it.

`read_own_weights` gives the layers their own forward back (the decoder is rebuilt or closed).

The weights stay the model's parameters, and a read or an edit of them works as before (an
edit is noticed by the model's weight watch, which packs again). What needs gradients, and a
copy of the model (``copy.deepcopy``, pickling), computes from the weights themselves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from genlm_fast.backend.llm import widen
from genlm_fast.ops import extension

__all__ = [
    "PanelSlice",
    "panel_product",
    "panel_rows",
    "read_panels",
    "read_own_weights",
    "reads_panels",
]

ROW_BLOCK = 64  # rows of x per call of linear_small_batch
PANEL = 16  # output features per panel


@dataclass(frozen=True, eq=False)
class PanelSlice:
    """Where one layer's weight [N, K] lies in packed panels.

    ``panels`` [P, K, 16] (a view of the decoder's store, in its layout and dtype: the panels
    may lie any distance apart) holds output features ``start`` .. ``start + out_features``
    of its P * 16, ``start`` < 16."""

    panels: torch.Tensor
    start: int
    out_features: int

    def __post_init__(self):
        p, _, width = self.panels.shape
        if width != PANEL or not 0 <= self.start < PANEL:
            raise ValueError(f"not a slice of {PANEL}-wide panels: {tuple(self.panels.shape)}")
        if -(-(self.start + self.out_features) // PANEL) != p:
            raise ValueError(
                f"{p} panels do not hold features {self.start}..{self.start + self.out_features}"
            )

    def __reduce__(self):
        # a copy of the model (deepcopy, pickling) reads its own copy of the weights: the
        # decoder's store is not copied along
        return (_no_slice, ())


def _no_slice():
    return None


def _pairs(panels: torch.Tensor) -> torch.Tensor:
    """Bfloat16 panels [P, K, 16] as they are laid out: their k-steps in pairs, [P, K / 2, 16,
    2] (`pack_linear_weight`)."""
    p, k, _ = panels.shape
    return panels.as_strided(
        (p, k // 2, PANEL, 2), (panels.stride(0), 2 * PANEL, 2, 1), panels.storage_offset()
    )


def panel_product(x: torch.Tensor, where: PanelSlice, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` in float32, W read from ``where``: x ``[..., K]`` (widened if 16-bit),
    the result ``[..., N]``."""
    x = x.float()
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    rows, n, start = x2.shape[0], where.out_features, where.start
    module = extension.load_module()  # (the fused decoder's, so any panels', _C)
    out = torch.empty((rows, n), dtype=torch.float32)
    for a in range(0, rows, ROW_BLOCK):
        b = min(rows, a + ROW_BLOCK)
        block = module.linear_small_batch(x2[a:b].contiguous(), where.panels, None, start + n)
        out[a:b] = block[:, start:] if start else block
    if bias is not None:
        out += bias.detach().float()
    return out.view(*lead, n)


def panel_rows(ids: torch.Tensor, where: PanelSlice) -> torch.Tensor:
    """Rows ``ids`` of W from ``where``, in the panels' dtype: ``[*ids.shape, K]``.

    Raises:
        IndexError: an id outside ``0 .. N - 1``.
    """
    n = where.out_features
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"index out of range: ids must lie in 0..{n - 1}")
    at = ids.long() + where.start
    panel, column = at // PANEL, at % PANEL
    if where.panels.dtype == torch.bfloat16:
        k = where.panels.shape[1]
        return _pairs(where.panels)[panel, :, column, :].reshape(*ids.shape, k)
    return where.panels[panel, :, column]


def _panel_forward(module, where, x):
    """A packed layer's forward (module docstring)."""
    weight = module.weight
    if (
        where is None
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return widen.linear_forward(module, x)  # (from the layer's own weights)
    return panel_product(x, where, module.bias)


def _panel_embedding_forward(module, where, ids):
    """A tied embedding's forward (module docstring)."""
    if where is None or ids.device.type != "cpu" or torch.is_grad_enabled():
        return type(module).forward(module, ids)
    rows = panel_rows(ids, where)
    scale = getattr(module, "embed_scale", None)  # (Gemma's scaled embedding)
    return rows if scale is None else rows * torch.as_tensor(scale).to(rows.dtype)


_FORWARDS = (_panel_forward, _panel_embedding_forward)


def read_panels(layers) -> None:
    """Give each ``(module, PanelSlice)`` of ``layers`` the forward that reads its panels (an
    embedding that renormalizes its rows, ``max_norm``, keeps its own)."""
    for module, where in layers:
        if isinstance(module, torch.nn.Embedding):
            if module.max_norm is None:
                module.forward = functools.partial(_panel_embedding_forward, module, where)
        else:
            module.forward = functools.partial(_panel_forward, module, where)


def reads_panels(module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func in _FORWARDS


def read_own_weights(model: torch.nn.Module) -> None:
    """Take the panel-reading forwards off ``model``'s layers (`read_panels`)."""
    for module in model.modules():
        if reads_panels(module):
            del module.__dict__["forward"]
