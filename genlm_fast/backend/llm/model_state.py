"""What every `AsyncTransformer` over one model shares: `ModelState`.

Several AsyncTransformers may wrap one model (``sharing`` it in tests, one per adapter set,
...). What they derive from its weights is made once and owned here: the fused decoder's
packed copies (`decoder.FusedDecoder`, or why there is none), which transformers' layers then
read too (`panel_layers`), the packed CPU linear layers of
transformers' forward (`cpu_linear`, counted: the last AsyncTransformer to close gives the
model its own layers back), a 16-bit CPU model's float32 forward (`widen`) and the one
`ModelWatch` that notices the weights changing. When
they change (noticed by the watch, or announced by `AsyncTransformer.reload_weights`), the
packed copies are rebuilt and ``generation`` moves on, which tells each AsyncTransformer to
forget the caches it computed before.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from genlm_fast.backend.llm.cpu_linear import (
    choose_kernel,
    drop_packed_copies,
    pack_linear_layers,
    unpack_linear_layers,
)
from genlm_fast.backend.llm.decoder import FusedDecoder, NoRoom, Unsupported
from genlm_fast.backend.llm.file_pages import release
from genlm_fast.backend.llm.panel_layers import read_own_weights, read_panels
from genlm_fast.backend.llm.widen import unwiden_forward, widen_forward
from genlm_fast.ops import extension

__all__ = ["ModelState", "ModelWatch"]

# each model's ModelState, while an open AsyncTransformer uses it
_states = weakref.WeakKeyDictionary()


class ModelState:
    """The packed weights of one model, who uses them, and the watch over its weights.

    Get it with `attach`, give it back with `detach`."""

    def __init__(self, model):
        self.users = 0  # open AsyncTransformers over the model
        self.linear_users = 0  # ... of them that packed its linear layers
        self.generation = 0  # weight changes seen
        self.stale = False
        self.decoder = None
        self.reason = None  # why there is no decoder
        self.watch = None
        self.rebuild(model, forget=False)

    @classmethod
    def attach(cls, model, cpu_linear):
        """The model's state, one more user counted; its linear layers packed with kernel
        ``cpu_linear`` (`cpu_linear.choose_kernel`) where the fused decoder does not run
        (which has its own packed copies). Returns ``(state, layers packed)``.

        Raises:
            ValueError: ``cpu_linear`` names no kernel, or one that does not run here (even
                where the fused decoder runs and the choice is not used yet).
        """
        choose_kernel(cpu_linear)
        state = _states.get(model)
        if state is None:
            state = _states[model] = cls(model)
        packed = 0 if state.decoder is not None else pack_linear_layers(model, cpu_linear)
        state.users += 1
        if packed:
            state.linear_users += 1
        return state, packed

    def detach(self, model, packed):
        """One user fewer (``packed``: it had packed the linear layers); the last one gives
        the model its own layers back and drops the packed copies."""
        self.users -= 1
        if packed:
            self.linear_users -= 1
            if self.linear_users == 0:  # the caller's model gets its own layers back
                unpack_linear_layers(model)
        if self.users == 0 and _states.get(model) is self:
            del _states[model]
            self.decoder = None
            read_own_weights(model)  # (the packed copy goes with the decoder)
            unwiden_forward(model)  # (nothing to undo unless it was widened)

    def rebuild(self, model, forget=True):
        """Read the model again; ``forget``: its answers may have changed, so the packed
        linear copies and the caches computed before go too (not for an adapter loaded
        through `AsyncTransformer`, which leaves the base model's answers as they were)."""
        self.stale = False
        self.decoder = None  # the old packed copies go before new ones are made
        read_own_weights(model)
        # a 16-bit CPU model's transformers forward computes in float32, as the fused decoder
        # does: a context's answers do not depend on which of them ran it (widen.py); again
        # after each change, for the modules an adapter added
        widen_forward(model)
        try:
            self.decoder, self.reason = FusedDecoder(model), None
            # transformers' forward (long prompts, adapters) reads the packed copy too: the
            # pages of the model's weights it was packed from went back to their file
            read_panels(self.decoder.panel_layers)
        except Unsupported as exc:
            self.reason = str(exc)
            if isinstance(exc, NoRoom):
                warnings.warn(
                    f"{exc}: decoding runs transformers' forward on the model's own weights",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self.watch = ModelWatch(model)
        if self.decoder is not None:
            # what the watch's first look mapped again goes back, but for what it reads
            release(self.decoder.sources, spare=self.watch.reads())
            self.decoder.gather_huge_pages()
        if forget:
            drop_packed_copies(model)
            self.generation += 1

    def weights_changed(self):
        """Say that the weights changed in a way the watch may not see: the next `sync`
        rebuilds."""
        self.stale = True

    def sync(self, model):
        """Rebuild if the model changed since the last build (or was said to)."""
        if self.stale or self.watch.changed():
            self.rebuild(model)


def _watch_module():
    """genlm_fast._C if it has the compiled `ModelWatch` check, else None."""
    module = extension.load_module()
    return module if module is not None and hasattr(module, "WeightWatch") else None


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
        module = _watch_module()
        self._impl = module.WeightWatch(self._tensors, self._dicts) if module is not None else None
        self._versions = (
            None
            if self._impl is not None
            else [(p.data_ptr(), p.dtype, _version(p), _sample(p)) for p in self._tensors]
        )

    def reads(self) -> list[tuple[int, int]]:
        """The memory `changed` reads, as ``[(address, bytes)]`` (what must stay mapped for
        it to stay cheap: `file_pages.release` spares it)."""
        if self._impl is not None:
            return self._impl.reads()
        out = []
        for p, (_, _, _, (at, _)) in zip(self._tensors, self._versions):
            if at is not None:
                out.extend((p.data_ptr() + int(i) * p.element_size(), p.element_size()) for i in at)
        return out

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
