"""Memory bounds of the LM caches: the key/value trie and the output cache hold to their
budgets (positions and bytes) with eviction, `clear_cache()` gives the memory back, a closed
model releases it, and ``genlm-fast info --model`` states what a position costs.

Budgets are checked against an independent recount of what is actually held (every stored
segment's own storage, not the trie's counters); memory against the process's resident set
(/proc/self/status; the caches against its anonymous part), in a fresh interpreter, with the
real SmolLM2-135M-Instruct.
"""

import asyncio
import contextlib
import gc
import io
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from bench.workers import child_env
from genlm_fast.backend.cache import KVTrie
from genlm_fast.backend.llm import AsyncTransformer
from genlm_fast.models import smollm2_path
from tests.backend.forward64 import load_ref64, logprobs64

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _held(trie):
    """(positions, bytes) of the segments the trie holds, recounted from the segments
    themselves; checks that every node's segment is one of them, and that a segment's data
    is a tensor of its own, or one slot of the trie's pool."""
    segments = {id(s): s for s in trie._lru.values()}
    positions = sum(s.data.shape[3] for s in segments.values())
    held = 0
    for s in segments.values():
        if s.slot is None:
            assert s.data.untyped_storage().nbytes() == s.data.nbytes  # not a view of more
        else:
            pool, chunk, index = s.slot
            assert pool is trie._pool and s.data.shape[3] == 1
            assert s.data.data_ptr() == pool.chunks[chunk][:, :, :, index].data_ptr()
        held += s.data.nbytes
    stack = [trie.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.seg is not None:
            assert id(node.seg) in segments, "a node reads a segment the trie no longer holds"
    return positions, held


def _node(trie, prefix):
    node = trie.root
    for t in prefix:
        node = node.children.get(t)
        if node is None:
            return None
    return node


def test_kv_trie_holds_both_budgets_and_its_data_under_random_inserts():
    """Random inserts (mostly one position, as SMC makes them; some longer), with shared
    prefixes: both budgets hold after every insert, by a recount of what is stored; every
    position match() finds holds the data inserted for it (pooled slots are reused, never
    while a segment still reads them); the pool stays within the budget and a spare chunk;
    clear() frees everything at once."""
    rng = random.Random(7)
    per_position = 2 * 2 * 3 * 4 * 4  # [layers=2, 2, heads=3, n, dim=4] float32
    trie = KVTrie(max_tokens=60, max_bytes=40 * per_position)
    expected = {}  # prefix -> the [2, 2, 3, 4] data its last position holds
    contexts = []
    held_runs = []
    for step in range(600):
        if contexts and rng.random() < 0.7:  # extend an earlier context (shared prefixes)
            base = list(rng.choice(contexts))
        else:
            base = [rng.randrange(50) for _ in range(rng.randint(1, 5))]
        depth, runs = trie.match(base)
        ids = base + [rng.randrange(50) for _ in range(1 if rng.random() < 0.8 else 4)]
        data = torch.randn(2, 2, 3, len(ids) - depth, 4)
        for p in range(depth, len(ids)):
            node = _node(trie, ids[: p + 1])
            if node is None or node.seg is None:
                expected[tuple(ids[: p + 1])] = data[:, :, :, p - depth].clone()
        if runs and step % 7 == 0:  # a caller holding runs matched before later evictions
            held_runs.append((list(runs), KVTrie.gather(runs)))
        trie.insert(ids, depth, data, runs)
        contexts.append(ids)
        positions, held = _held(trie)
        assert (positions, held) == (trie.n_tokens, trie.n_bytes)
        assert positions <= 60 and held <= 40 * per_position, step
        for probe in (ids, rng.choice(contexts)):
            d, runs = trie.match(probe)
            if d:
                got = KVTrie.gather(runs)
                want = torch.stack([expected[tuple(probe[: p + 1])] for p in range(d)], dim=3)
                assert torch.equal(got, want), step
        pool = trie._pool
        if pool is not None:
            assert len(pool.chunks) <= 2 + -(-40 // pool.slots), len(pool.chunks)
    for runs, copy in held_runs:  # what they read is still what they read then
        assert torch.equal(KVTrie.gather(runs), copy)
    assert trie.n_tokens > 0 and trie._pool is not None
    # clear() frees the segments at once, not when the garbage collector next runs
    held = [weakref.ref(s.data) for s in trie._lru.values()]
    chunks = [weakref.ref(c) for c in trie._pool.chunks.values()]
    del data, runs, held_runs, got, copy, pool
    gc.disable()
    try:
        trie.clear()
        assert all(ref() is None for ref in held + chunks)
    finally:
        gc.enable()
    assert (trie.n_tokens, trie.n_bytes, len(trie)) == (0, 0, 0)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_real_model_caches_hold_their_bounds():
    lm = AsyncTransformer.from_name(smollm2_path(), cache_size=64, kv_cache_tokens=100_000)
    per_position = lm.kv_bytes_per_token
    budget = 150 * per_position + per_position // 2  # bytes, not a whole number of positions
    bounded = AsyncTransformer(
        lm.model, lm.tokenizer, cache_size=64, kv_cache_tokens=100_000, kv_cache_bytes=budget
    )
    ref64 = load_ref64(smollm2_path())
    try:
        rng = random.Random(3)
        contexts = []  # every run's particles
        for _ in range(5):  # short SMC-shaped runs, new prompts each
            particles = [[rng.randrange(1000, 40000) for _ in range(6)] for _ in range(8)]
            contexts += particles
            for _ in range(8):
                rows = await asyncio.gather(*(bounded.next_token_logprobs(p) for p in particles))
                for p, row in zip(particles, rows):
                    p.append(int(torch.multinomial(row.exp(), 1)))
                trie = bounded._kv_tries[None]
                positions, held = _held(trie)
                assert (positions, held) == (trie.n_tokens, trie.n_bytes)
                assert held <= budget
                assert len(bounded._outputs) <= 64
                for seg in trie._lru.values():  # the stated cost is the real one
                    assert seg.data.nbytes == seg.data.shape[3] * per_position
        assert held > budget - 30 * per_position  # full: it evicts, it does not just stay low

        # evicting changed no answer: contexts never asked before (no output-cache answer)
        # whose past the trie holds partly (leaves evicted), wholly, or not at all, each
        # answered over what the trie holds then, against a float64 forward
        def kind(p):
            depth, _ = trie.match(p)
            return "none" if depth == 0 else "wholly" if depth >= len(p) - 1 else "partly"

        seen = {"partly": 0, "wholly": 0, "none": 0}
        # the partly held first: each answer stores its states and may evict other pasts
        for p in sorted(contexts, key=lambda p: kind(p) != "partly"):
            if seen[kind(p)] >= 3:
                continue
            seen[kind(p)] += 1
            row = await bounded.next_token_logprobs(p)
            torch.testing.assert_close(row.double(), logprobs64(ref64, p), rtol=0, atol=1e-3)
        assert seen["partly"] > 0, seen  # the case eviction can break
        # a zero budget turns key/value reuse off
        off = AsyncTransformer(lm.model, lm.tokenizer, kv_cache_bytes=0)
        for p in (particles[0], particles[0] + [5]):  # the second: its past is not kept
            torch.testing.assert_close(
                off.next_token_logprobs_sync(p).double(), logprobs64(ref64, p), rtol=0, atol=1e-3
            )
        assert off._kv_tries == {}
        off.cleanup()
        for bad in (-1, 1.5, "1GB", True, float("inf")):
            with pytest.raises(ValueError, match="kv_cache_bytes"):
                AsyncTransformer(lm.model, lm.tokenizer, kv_cache_bytes=bad)
    finally:
        bounded.cleanup()
        lm.cleanup()


@pytest.mark.slow
def test_info_states_the_cost_of_a_position():
    from genlm_fast.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", "--model", smollm2_path()]) == 0
    text = out.getvalue()
    per_position = int(re.search(r"([\d,]+) bytes per position", text).group(1).replace(",", ""))
    lm = AsyncTransformer.from_name(smollm2_path())
    try:
        lm.next_token_logprobs_sync(lm.tokenizer.encode("The capital of France is"))
        (seg,) = lm._kv_tries[None]._lru.values()
        assert per_position == seg.data.nbytes // seg.data.shape[3]  # what a position holds
    finally:
        lm.cleanup()
    budget = re.search(r"kv_cache_tokens=16384 holds up to ([\d.,]+) MB", text).group(1)
    assert float(budget.replace(",", "")) == pytest.approx(16384 * per_position / 1e6, abs=0.1)
    assert "output cache: 49,152 float32 log-probabilities a row" in text


_MEMORY_CHILD = textwrap.dedent("""
    import asyncio, gc, json, random, warnings
    warnings.simplefilter("ignore")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer  # (their modules load lazily)
    from genlm_fast.backend.llm import AsyncTransformer
    from genlm_fast.models import smollm2_path

    def rss():
        # resident MB: all of it, and the anonymous part alone (the caches are anonymous
        # memory; the checkpoint's pages mapped from its file come and go with the page cache)
        with open("/proc/self/status") as f:
            fields = (line.split(":", 1) for line in f)
            kb = {k: int(v.split()[0]) for k, v in fields if k.startswith("Rss")}
        mb = 1024 / 1e6  # /proc's kB are KiB
        return {"total": (kb["RssAnon"] + kb["RssFile"] + kb["RssShmem"]) * mb,
                "anon": kb["RssAnon"] * mb}

    out = {"base": rss()}
    lm = AsyncTransformer.from_name(smollm2_path())
    rng = random.Random(0)
    lm.next_token_logprobs_sync([1, 2, 3])
    lm.clear_cache()
    out["loaded"] = rss()
    out["weights_mb"] = sum(p.numel() * p.element_size() for p in lm.model.parameters()) / 1e6

    async def fill():
        for _ in range(12):  # 12 runs x 8 particles x 16 tokens, new prompts
            parts = [[rng.randrange(1000, 40000) for _ in range(8)] for _ in range(8)]
            for _ in range(16):
                rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))
                for p, row in zip(parts, rows):
                    p.append(int(torch.multinomial(row.exp(), 1)))

    asyncio.run(fill())
    trie = lm._kv_tries[None]
    rows = sum(r.numel() * 4 for _, r in lm._outputs.cache.values())
    out["cached_mb"] = (trie.n_bytes + rows) / 1e6
    out["filled"] = rss()
    lm.clear_cache()
    gc.collect()
    out["cleared"] = rss()
    asyncio.run(fill())
    out["refilled"] = rss()
    lm.cleanup()
    del lm, trie
    gc.collect()
    out["closed"] = rss()
    lm = AsyncTransformer.from_name(smollm2_path())  # a second model, used and closed
    asyncio.run(fill())
    lm.cleanup()
    del lm
    gc.collect()
    out["closed_again"] = rss()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_clear_cache_and_cleanup_give_memory_back():
    """Resident memory in a fresh interpreter: filling the caches raises it by about what
    they hold; clear_cache() gives back at least two thirds of that (glibc keeps what its
    heap cannot hand back in whole pages: measured 19-26% left); a second fill reuses the
    memory instead of adding to it; cleanup() releases the model (at least 90% of its
    weights' bytes: what loading added beyond them is the allocator's and the imported
    modules'), and a second model, loaded, used and closed, leaves no more behind than the
    first."""
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    anon = {k: v["anon"] for k, v in m.items() if isinstance(v, dict)}
    total = {k: v["total"] for k, v in m.items() if isinstance(v, dict)}
    # the caches against anonymous memory, where they live
    grown = anon["filled"] - anon["loaded"]
    assert m["cached_mb"] > 150, m  # the caches did fill
    assert grown > 0.8 * m["cached_mb"], m
    assert anon["cleared"] - anon["loaded"] < grown / 3, m
    assert anon["refilled"] - anon["filled"] < 0.25 * grown, m
    # the weights against everything resident: the packed copy is anonymous, transformers'
    # parameters are pages of the checkpoint's file
    assert total["loaded"] - total["closed"] > 0.9 * m["weights_mb"], m  # the weights went back
    assert total["closed_again"] - total["closed"] < 50, m
