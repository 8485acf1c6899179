"""The vocabulary the GPU benchmark builds its trie from: quicktok's encoding, a file
written by ``--dump-vocab`` where quicktok is (the GPU machine may lack it), or, for the dry
run only, a synthetic one."""

from __future__ import annotations

import pickle
from pathlib import Path

DRY_RUN_TOKENS = 500  # the dry run's vocabulary: its first tokens (or synthetic ones)


def _quicktok_pairs(name: str):
    """``[(token_id, bytes), ...]`` of a quicktok encoding (`bench.vocabs.quicktok_vocab`:
    placeholders where an id has no bytes)."""
    from bench.vocabs import quicktok_vocab

    return [(t.token_id, t.byte_string) for t in quicktok_vocab(name)]


def dump_vocab(name: str, path: str) -> None:
    """Pickle ``[(token_id, bytes), ...]`` (plain tuples: no package needed to read it)."""
    pairs = _quicktok_pairs(name)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({"name": name, "tokens": pairs}, f, protocol=4)
    print(f"wrote {len(pairs)} tokens of {name} to {path}")


def synthetic_pairs(n: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    seen, pairs = set(), []
    for b in range(256):
        seen.add(bytes([b]))
        pairs.append((b, bytes([b])))
    while len(pairs) < n:
        bs = bytes(rng.choice(b"etaoinshrdlu _") for _ in range(rng.randint(2, 8)))
        if bs not in seen:
            seen.add(bs)
            pairs.append((len(pairs), bs))
    return pairs


def load_vocab(name: str, vocab_file: str | None, limit: int | None = None):
    """``(label, [genlm_fast Token])`` from a ``--dump-vocab`` file or quicktok (or, for the
    dry run only, synthetic)."""
    from genlm_fast.backend.tokenization import Token

    if vocab_file:
        with open(vocab_file, "rb") as f:
            data = pickle.load(f)
        label, pairs = data["name"], data["tokens"]
    else:
        try:
            pairs = _quicktok_pairs(name)
            label = name
        except Exception as e:
            if limit is None:
                raise SystemExit(
                    f"cannot load vocabulary {name!r} ({type(e).__name__}: {e}); "
                    "create a file elsewhere with `python -m tools.gpu.bench --dump-vocab "
                    "PATH` and pass --vocab-file PATH"
                ) from e
            pairs, label = synthetic_pairs(limit), "synthetic"
    if limit is not None and len(pairs) > limit:
        pairs, label = pairs[:limit], f"{label}[:{limit}]"
    return label, [Token(int(i), bytes(b)) for i, b in pairs]
