"""Make ``genlm.backend…`` and ``genlm.bytes…`` imports resolve to genlm_fast.

    import genlm_fast.dropin          # in an app, before it imports genlm
    pytest -p genlm_fast.dropin       # for a test suite, e.g. genlm's own

An import hook (a finder at the front of ``sys.meta_path``) answers every import of a name
under ``genlm.backend`` or ``genlm.bytes`` with the genlm_fast module of the same path, so
``genlm.backend.trie.TokenCharacterTrie is genlm_fast.backend.trie.TokenCharacterTrie``.
Because it is a finder rather than a one-off ``sys.modules`` patch, it keeps working when a
test removes the ``genlm.*`` entries from ``sys.modules`` (genlm's own conftest does that).
Other ``genlm.*`` packages (``genlm.control``, ``genlm.grammar``) are left alone.
genlm's modules that genlm_fast does not offer (``NOT_PROVIDED``: the MLX and SGLang
backends) raise an ImportError saying so.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

ALIASES = {"genlm.backend": "genlm_fast.backend", "genlm.bytes": "genlm_fast.bytes"}

# genlm-backend 0.3.1 modules with no genlm_fast counterpart: what they hold
NOT_PROVIDED = {
    "genlm.backend.llm.mlx": "the MLX backend AsyncMlxLM",
    "genlm.backend.llm.sgl": "the SGLang backend AsyncSGLTransformer",
}


def target_of(fullname: str) -> str | None:
    """The genlm_fast module name an aliased genlm module name maps to (or None)."""
    for prefix, target in ALIASES.items():
        if fullname == prefix or fullname.startswith(prefix + "."):
            return target + fullname[len(prefix) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target
        self._own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # the import system stamped the alias spec on the module; give it back its own
        if self._own_spec is not None:
            module.__spec__ = self._own_spec


class _NotProvidedLoader(importlib.abc.Loader):
    """Fails the import of a genlm module that genlm_fast does not offer, saying so."""

    def create_module(self, spec):
        raise ModuleNotFoundError(
            f"genlm_fast does not provide {spec.name}, {NOT_PROVIDED[spec.name]}, and "
            "genlm_fast.dropin routes genlm.backend imports to genlm_fast: use "
            "AsyncTransformer or AsyncVirtualLM, or run without the drop-in",
            name=spec.name,
        )

    def exec_module(self, module):  # never reached: create_module raises
        pass


class GenlmAliasFinder(importlib.abc.MetaPathFinder):
    """Resolve genlm.backend / genlm.bytes (and their submodules) to genlm_fast."""

    # how install() and uninstall() recognise a finder of this module: by this mark, not
    # by isinstance, so that a finder from before an importlib.reload of it counts too
    GENLM_FAST_ALIAS = True

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "genlm":
            # genlm is a namespace package; provide an empty one if no genlm is installed
            if importlib.machinery.PathFinder.find_spec("genlm") is None:
                spec = importlib.machinery.ModuleSpec("genlm", None, is_package=True)
                spec.submodule_search_locations = []
                return spec
            return None
        aliased = target_of(fullname)
        if aliased is None:
            return None
        if fullname in NOT_PROVIDED:
            return importlib.machinery.ModuleSpec(fullname, _NotProvidedLoader())
        if importlib.util.find_spec(aliased) is None:
            return None  # a genlm module genlm_fast does not provide: ModuleNotFoundError
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(aliased), is_package=_is_package(aliased)
        )


def _is_package(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.submodule_search_locations is not None


def _is_alias_finder(finder) -> bool:
    return getattr(finder, "GENLM_FAST_ALIAS", False) is True


def install() -> None:
    """Put the finder first on ``sys.meta_path`` and drop genlm modules already imported."""
    if not any(map(_is_alias_finder, sys.meta_path)):
        sys.meta_path.insert(0, GenlmAliasFinder())
    real = [
        name
        for name in sys.modules
        if target_of(name) is not None and not sys.modules[name].__name__.startswith("genlm_fast")
    ]
    for name in real:
        del sys.modules[name]
    if real:
        users = sorted(
            {
                n.split(".")[1]
                for n in sys.modules
                if n.startswith("genlm.") and target_of(n) is None
            }
        )
        warnings.warn(
            f"genlm_fast.dropin was imported after {', '.join(sorted(real)[:3])}"
            f"{', ...' if len(real) > 3 else ''}: later imports get genlm_fast, but modules "
            "that had already imported genlm's classes keep them"
            + (f" (loaded: {', '.join('genlm.' + u for u in users)})" if users else "")
            + ", and mixing the two fails in confusing ways. Import genlm_fast.dropin "
            "first, before any genlm package.",
            RuntimeWarning,
            stacklevel=2,
        )


def uninstall() -> None:
    """Take the finder off ``sys.meta_path`` and forget the aliased modules, so that the
    next import of genlm.backend / genlm.bytes finds genlm's own packages (when installed)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not _is_alias_finder(f)]
    for name in list(sys.modules):
        if target_of(name) is not None:
            del sys.modules[name]


install()
