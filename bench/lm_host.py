"""The host's work per decoding step of a GPU-shaped LM path, the forward itself excluded.

    python -m bench.lm_host [--rows 16] [--steps 40] [--rounds 5] [--prompt 24] [--out FILE.md]

On a GPU the forward of a one-token step is a replayed CUDA graph (a few ms for a small
model on an H200); what the host does around it (matching each row's past, preparing the
step's inputs, storing the new states) decides whether a round is bound by the device or by
Python. This benchmark measures that host work on the CPU, for the two step paths of
`AsyncTransformer`:

* ``buckets`` (``cuda_graphs``, `genlm_fast.backend.llm.graphs`): each row's past copied
  into its bucket row, a mask and inputs built, the new states stored row by row;
* ``paged`` (``paged_kv=True``, `genlm_fast.backend.llm.paged_forward`): the rows' block
  tables and slots planned on the trie, one copy of the step's inputs, the trie updated.

Both run `AsyncTransformer._forward` over SmolLM2-135M's architecture (30 layers, 3
key/value heads of 64, a 49,152-token vocabulary) with the model's forward replaced by a
stand-in of no cost, as a replayed graph is to the host: it hands back the recorded
forward's outputs (zero logits, one column wide: the V-wide copies and checks of the logits
are the device's work on a GPU; for the buckets, the cache object whose layers hold the new
states). The key/value states live on PyTorch's ``meta``
device, so copies move no bytes and what is timed is what the host does (on a GPU the
copies are the device's work, queued by the host). The workload is SMC: ``--rows``
particles sharing a ``--prompt``-token prompt, each step adding a token to every particle,
a particle resampled (duplicated over another) every other step. The paths alternate
round by round; the best round of each is reported, in ms per step.
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.machine import machine_line
from bench.report import write_report

PATHS = ("buckets", "paged")


def smollm2_shaped_model():
    """SmolLM2-135M's architecture on the meta device (no weights are needed)."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    return model.eval()


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from genlm_fast.models import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path(quiet=True))


def make_lm(path, model, tokenizer, kv_tokens):
    """An AsyncTransformer on ``path`` whose forward is the stand-in (module docstring)."""
    from genlm_fast.backend.llm import AsyncTransformer
    from genlm_fast.backend.llm.graphs import DecodeGraphs, GraphsEngine
    from genlm_fast.backend.llm.kv_buffer import buffer_cache
    from genlm_fast.backend.llm.paged_kv import PagedKVPool, PagedKVTrie

    config = model.config
    L, H, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    # what a replay leaves in its output, one column wide: copying and checking a V-wide row
    # is the device's work on a GPU (here it would be the CPU's, and timed)
    logits = torch.zeros((64, 1, 1))
    if path == "paged":
        lm = AsyncTransformer(model, tokenizer, paged_kv=True, kv_cache_tokens=kv_tokens)

        engine = lm._forwards.paged

        def new_trie(tokens, max_bytes):
            blocks = kv_tokens // engine.PAGE + 1
            return PagedKVTrie(PagedKVPool(L, H, D, torch.float32, "meta", blocks, engine.PAGE))

        engine.new_trie = new_trie
        # a replay: the new states are written by the recorded forward, on the device
        engine.forward._call = lambda kv, input_ids, *rest: logits[: input_ids.shape[0], -1]
        return lm

    lm = AsyncTransformer(model, tokenizer, cuda_graphs=False, kv_cache_tokens=kv_tokens)
    eager = lm._forwards.eager
    graphs = DecodeGraphs(model, eager.keeps_logits, capture=False)
    lm._forwards.graphs = GraphsEngine(graphs, eager)

    def bucket_call(bucket):
        # a replay: the recorded forward's cache object, its layers filled to the bucket's
        # length, made once per bucket as the recording does
        if bucket.cache is None:
            bucket.cache = buffer_cache(bucket.kv, bucket.length - 1)
            states = torch.zeros((bucket.rows, H, 1, D), device="meta")
            for layer in bucket.cache.layers:
                layer.update(states, states)
        return logits[: bucket.rows], bucket.cache

    graphs._call = bucket_call
    return lm


def prefill(lm, path, prompt, model):
    """Store the prompt's states (meta) as a forward over it would."""
    config = model.config
    L, H, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    trie = lm._kv_trie(None)
    if path == "paged":
        plan = trie.plan([prompt])
        trie.commit(plan)
    else:
        trie.insert(prompt, 0, torch.zeros((L, 2, H, len(prompt), D), device="meta"))


def run_steps(lm, particles, steps, rng):
    """``steps`` SMC steps; returns the seconds of each."""
    times = []
    for step in range(steps):
        rows = [list(p) for p in particles]
        start = time.perf_counter()
        lm._forward(None, rows)
        times.append(time.perf_counter() - start)
        for p in particles:
            p.append(rng.randrange(2, 40000))
        if step % 2:
            particles[rng.randrange(len(particles))] = list(rng.choice(particles))
    return times


def measure(rows=16, steps=40, rounds=5, prompt_len=24):
    model = smollm2_shaped_model()
    kv_tokens = 1 << 16
    tokenizer = smollm2_tokenizer()
    lms = {path: make_lm(path, model, tokenizer, kv_tokens) for path in PATHS}
    prompt = list(range(100, 100 + prompt_len))
    best = {path: float("inf") for path in PATHS}
    medians = {path: [] for path in PATHS}
    for r in range(rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            lm = lms[path]
            lm.clear_cache()
            prefill(lm, path, prompt, model)
            particles = [prompt + [7 + i] for i in range(rows)]
            times = run_steps(lm, particles, steps + 2, random.Random(r))[2:]
            times.sort()
            best[path] = min(best[path], sum(times) / len(times))
            medians[path].append(times[len(times) // 2])
    for lm in lms.values():
        lm.cleanup()
    return {
        path: {"mean_ms": best[path] * 1e3, "median_ms": min(medians[path]) * 1e3} for path in PATHS
    }


def report(result, rows, steps, rounds, prompt_len):
    lines = [
        "# Host work per decoding step, forward excluded (python -m bench.lm_host)",
        "",
        f"- machine: {machine_line()}",
        f"- workload: SMC, {rows} particles over a {prompt_len}-token prompt, {steps} steps "
        f"a round (pasts {prompt_len + 1}-{prompt_len + steps + 2} tokens), {rounds} rounds, "
        "paths alternated; SmolLM2-135M's architecture, states on the meta device",
        "",
        "| path | ms/step (best round, mean) | ms/step (best round, median) |",
        "|---|---:|---:|",
    ]
    for path in PATHS:
        r = result[path]
        lines.append(f"| {path} | {r['mean_ms']:.3f} | {r['median_ms']:.3f} |")
    ratio = result["buckets"]["mean_ms"] / result["paged"]["mean_ms"]
    lines += ["", f"buckets / paged: {ratio:.1f}x", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=24)
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    for name in ("rows", "steps", "rounds", "prompt"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    result = measure(args.rows, args.steps, args.rounds, args.prompt)
    text = report(result, args.rows, args.steps, args.rounds, args.prompt)
    write_report(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
