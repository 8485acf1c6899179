"""The on-disk cache of compiled trie layouts: one pickled ``TrieLayout`` per vocabulary
and options (`vocab_digest`), checked on reading (`load_cached`), written atomically
(`store_cached`)."""

from __future__ import annotations

import hashlib
import os
import pickle
import threading

import genlm_fast
from genlm_fast.ops import layout
from genlm_fast.ops.layout import TrieLayout

__all__ = ["default_cache_dir", "load_cached", "store_cached", "vocab_digest"]


def default_cache_dir() -> str:
    """Where layouts are cached: ``<genlm_fast cache root>/tries`` (`genlm_fast.cache_dir`)."""
    return genlm_fast.cache_dir("tries")


def vocab_digest(*parts) -> str:
    """A key for the on-disk cache: a hash of the vocabulary's contents and options."""
    # read from the module at each call: the key follows the values layouts are built with
    h = hashlib.sha256(f"v{layout.LAYOUT_VERSION}/tile{layout.TILE}".encode())
    for part in parts:
        h.update(pickle.dumps(part, protocol=4))
    return h.hexdigest()[:32]


# A cache file: _CACHE_MAGIC, the SHA-256 of the payload, the pickled TrieLayout. The
# checksum turns a damaged file (a flipped byte, a foreign file) into a rebuild instead of
# an exception or, worse, a layout that silently computes wrong masses.
_CACHE_MAGIC = b"genlm_fast trie layout\n"


def load_cached(digest: str, cache_dir: str | None):
    """The cached layout of ``digest``, or None when there is none or it is damaged."""
    path = os.path.join(cache_dir or default_cache_dir(), digest + ".pkl")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = len(_CACHE_MAGIC) + 32
    if (
        not data.startswith(_CACHE_MAGIC)
        or hashlib.sha256(memoryview(data)[head:]).digest() != data[len(_CACHE_MAGIC) : head]
    ):
        return None
    try:
        layout = pickle.loads(memoryview(data)[head:])
    except Exception:
        return None
    return layout if isinstance(layout, TrieLayout) else None


def store_cached(digest: str, layout: TrieLayout, cache_dir: str | None) -> None:
    directory = cache_dir or default_cache_dir()
    payload = pickle.dumps(layout, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(_CACHE_MAGIC)
            f.write(hashlib.sha256(payload).digest())
            f.write(payload)
        os.replace(tmp, os.path.join(directory, digest + ".pkl"))
    except OSError:
        pass  # a read-only home must not break trie construction
