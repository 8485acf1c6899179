"""genlm_fast: fused GPU/CPU trie kernels and a genlm.backend / genlm.bytes compatible API.

    from genlm_fast.backend.tokenization import decode_vocab
    from genlm_fast.backend.trie import TokenCharacterTrie
    from genlm_fast.bytes import TokenByteTrie, TrieMode

Every trie offers genlm's ``weight_sum`` / ``weight_max`` (and batch forms) plus the fused
``log_mass`` / ``batch_log_mass`` (logits in, log-mass of every node out, on the device).
"""

import os

__version__ = "0.1.0"


def cache_dir(*parts: str) -> str:
    """A folder under genlm_fast's cache root (tries' layouts, JIT builds, the model).

    The root is ``$GENLM_FAST_CACHE`` when set, else ``$XDG_CACHE_HOME/genlm_fast``, else
    ``~/.cache/genlm_fast``. As the XDG base-directory specification asks, an empty or
    relative ``$XDG_CACHE_HOME`` is ignored (it would put the caches under whatever the
    working directory is).
    """
    root = os.environ.get("GENLM_FAST_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        if not os.path.isabs(xdg):
            xdg = os.path.expanduser("~/.cache")
        root = os.path.join(xdg, "genlm_fast")
    return os.path.join(os.path.expanduser(root), *parts)
