"""Soak benchmark: resident memory over many short runs on one model.

    flock /tmp/genlm_cpu.lock python -m bench.soak [--runs 240] [--kv-cache-bytes N] [--out FILE]

One ``AsyncTransformer`` on SmolLM2-135M-Instruct serves, in turn, short SMC-shaped runs
(``--particles`` particles x ``--tokens`` tokens: every step, each particle's
``next_token_logprobs`` concurrently, then a token drawn from it; a new random 8-token prompt
each run) and, every ``--beam-every`` runs, a byte-level beam (K=5: prefill a new 16-byte
prompt, then 8 bytes with ``logp_next`` before each). Thousands of steps, all on new
contexts, so the output cache and the key/value trie fill to their bounds and then evict.

Recorded after every run: resident memory (/proc/self/statm), the C heap's bytes in use and
free (glibc's mallinfo2: free heap that stays resident is fragmentation), the key/value
trie's positions and bytes, the output cache's rows. With the defaults the key/value budget
(16384 positions) fills by run ~90 of 240. The run passes when memory plateaus: over the
last half of the runs, resident memory grows by less than ``--plateau-mb`` (default 64 MB),
and it stays under the loaded model (after a first run of each kind) plus the caches'
bounds (key/value budget + output cache rows x vocabulary x 4 bytes) plus 25%. Then
``clear_cache()`` and ``cleanup()`` are each timed and their effect on resident memory shown.
Writes ``--out`` (default ``bench/results/soak-<date>.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.beams import advance, make_beam  # noqa: E402 (after the checkout's path)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def heap_mb():
    """(in use, free) MB of the C heap's arenas (glibc's mallinfo2), or (0, 0)."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return 0.0, 0.0
    fn.restype = Info
    info = fn()
    return info.uordblks / 1e6, info.fordblks / 1e6


async def smc_run(lm, prompt, particles, tokens, gen):
    import torch

    contexts = [list(prompt) for _ in range(particles)]
    log_weights = torch.zeros(particles, dtype=torch.float64)
    for _ in range(tokens):
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        for i, (c, row) in enumerate(zip(contexts, rows)):
            tok = int(torch.multinomial(row.exp(), 1, generator=gen))
            log_weights[i] += float(row[tok])
            c.append(tok)
    return log_weights


async def beam_run(lm, prompt, steps):
    """The byte beam (K=5) on genlm_fast: ``prompt`` prefilled, then the bytes of ``steps``."""
    beam = await make_beam("genlm_fast", lm, K=5)
    logp, _ = await advance(beam, prompt, steps)
    return logp


def run(
    runs=240,
    particles=8,
    tokens=20,
    beam_every=4,
    kv_cache_bytes=None,
    cache_size=1024,
    seed=0,
    log=print,
):
    import torch

    from genlm_fast.backend.llm import AsyncTransformer
    from genlm_fast.models import smollm2_path

    warnings.simplefilter("ignore")
    before_load = rss_mb()
    lm = AsyncTransformer.from_name(
        smollm2_path(), kv_cache_bytes=kv_cache_bytes, cache_size=cache_size
    )
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    words = [
        w.encode()
        for w in (
            "river",
            "stone",
            "light",
            "paper",
            "north",
            "glass",
            "quiet",
            "seven",
            "amber",
            "field",
            "cloud",
            "tower",
        )
    ]
    loop = asyncio.new_event_loop()
    # loaded = after a first run of each kind (weights read, the beam's trie built), caches
    # emptied
    loop.run_until_complete(smc_run(lm, [1, 2, 3], 2, 2, gen))
    if beam_every:
        loop.run_until_complete(beam_run(lm, b"Hello", b" w"))
    lm.clear_cache()
    gc.collect()
    loaded = rss_mb()
    trace = []
    steps = 0
    started = time.perf_counter()
    for r in range(runs):
        prompt = [rng.randrange(1000, 40000) for _ in range(8)]
        loop.run_until_complete(smc_run(lm, prompt, particles, tokens, gen))
        steps += particles * tokens
        if beam_every and r % beam_every == beam_every - 1:
            text = b" ".join(rng.choice(words) for _ in range(3)).capitalize()[:16]
            loop.run_until_complete(beam_run(lm, text, b" and the"))
            steps += 9
        trie = lm._kv_tries.get(None)
        heap = heap_mb()
        trace.append(
            {
                "run": r + 1,
                "rss_mb": rss_mb(),
                "steps": steps,
                "heap_used_mb": heap[0],
                "heap_free_mb": heap[1],
                "kv_positions": trie.n_tokens if trie else 0,
                "kv_mb": (trie.n_bytes if trie else 0) / 1e6,
                "output_rows": len(lm._outputs),
                "seconds": time.perf_counter() - started,
            }
        )
        if (r + 1) % 10 == 0:
            t = trace[-1]
            log(
                f"run {r + 1}: rss {t['rss_mb']:.0f} MB (heap {t['heap_used_mb']:.0f} used, "
                f"{t['heap_free_mb']:.0f} free), kv {t['kv_positions']} positions "
                f"({t['kv_mb']:.0f} MB), {t['output_rows']} output rows, "
                f"{t['seconds']:.0f} s"
            )
    kv_budget = lm.kv_cache_tokens * lm.kv_bytes_per_token
    if lm.kv_cache_bytes is not None:
        kv_budget = min(kv_budget, lm.kv_cache_bytes)
    outputs_budget = max(0, lm.cache_size) * lm.model.config.vocab_size * 4
    t = time.perf_counter()
    lm.clear_cache()
    gc.collect()
    cleared = {"rss_mb": rss_mb(), "seconds": time.perf_counter() - t}
    t = time.perf_counter()
    lm.cleanup()
    del lm
    gc.collect()
    closed = {"rss_mb": rss_mb(), "seconds": time.perf_counter() - t}
    loop.close()
    return {
        "before_load_mb": before_load,
        "loaded_mb": loaded,
        "trace": trace,
        "kv_budget_mb": kv_budget / 1e6,
        "outputs_budget_mb": outputs_budget / 1e6,
        "cleared": cleared,
        "closed": closed,
        "steps": steps,
    }


def verdict(result, plateau_mb=64.0):
    trace = result["trace"]
    half = trace[len(trace) // 2 :]
    growth = max(t["rss_mb"] for t in half) - half[0]["rss_mb"]
    ceiling = result["loaded_mb"] + 1.25 * (result["kv_budget_mb"] + result["outputs_budget_mb"])
    peak = max(t["rss_mb"] for t in trace)
    return [
        (
            (
                f"plateau: resident memory grew {growth:.0f} MB over the last {len(half)} runs "
                f"(< {plateau_mb:.0f} MB)"
            ),
            growth < plateau_mb,
        ),
        (
            (
                f"bounded: peak {peak:.0f} MB <= loaded model {result['loaded_mb']:.0f} MB "
                f"+ 1.25 x "
                f"(key/value budget {result['kv_budget_mb']:.0f} MB + output cache "
                f"{result['outputs_budget_mb']:.0f} MB) = {ceiling:.0f} MB"
            ),
            peak <= ceiling,
        ),
    ]


def report(result, args, command):
    from bench import machine

    trace = result["trace"]
    lines = [
        "# Soak: resident memory over many short runs on one model",
        "",
        f"`{command}`",
        "",
        f"- machine: {machine.cpu_model()}, {os.cpu_count()} CPUs; commit {machine.git_commit()}",
        (
            f"- {len(trace)} runs ({args.particles} particles x {args.tokens} tokens, a "
            f"byte beam every {args.beam_every}), {result['steps']} steps, "
            f"{trace[-1]['seconds']:.0f} s"
        ),
        (
            f"- kv_cache_bytes: {args.kv_cache_bytes}; key/value budget "
            f"{result['kv_budget_mb']:.0f} MB, output cache bound "
            f"{result['outputs_budget_mb']:.0f} MB"
        ),
        (
            f"- resident memory: {result['before_load_mb']:.0f} MB before loading, "
            f"{result['loaded_mb']:.0f} MB loaded (after a first run of each kind, caches "
            "emptied)"
        ),
        "",
        (
            "| run | steps | resident MB | C heap in use / free MB | key/value positions | "
            "key/value MB | output rows |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    every = max(1, len(trace) // 16)
    for t in trace[every - 1 :: every]:
        lines.append(
            f"| {t['run']} | {t['steps']} | {t['rss_mb']:.0f} | "
            f"{t['heap_used_mb']:.0f} / {t['heap_free_mb']:.0f} | {t['kv_positions']} | "
            f"{t['kv_mb']:.0f} | {t['output_rows']} |"
        )
    lines += [
        "",
        (
            f"- after `clear_cache()`: {result['cleared']['rss_mb']:.0f} MB "
            f"({1e3 * result['cleared']['seconds']:.0f} ms)"
        ),
        (
            f"- after `cleanup()`: {result['closed']['rss_mb']:.0f} MB "
            f"({1e3 * result['closed']['seconds']:.0f} ms)"
        ),
        "",
    ]
    lines += [
        f"- {'met' if ok else 'NOT met'}: {text}" for text, ok in verdict(result, args.plateau_mb)
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    from bench.report import command_line, write_report

    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--runs", type=int, default=240)
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--beam-every", type=int, default=4, help="0: no byte beams")
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="AsyncTransformer's kv_cache_bytes (default: none)",
    )
    parser.add_argument(
        "--cache-size",
        type=int,
        default=1024,
        help="AsyncTransformer's cache_size, output rows (default 1024)",
    )
    parser.add_argument("--plateau-mb", type=float, default=64.0)
    parser.add_argument(
        "--out", default=None, help="markdown output (default bench/results/soak-<date>.md)"
    )
    args = parser.parse_args(argv)
    result = run(
        args.runs,
        args.particles,
        args.tokens,
        args.beam_every,
        args.kv_cache_bytes,
        args.cache_size,
    )
    out = write_report(report(result, args, command_line("bench.soak", argv)), args.out, "soak")
    print(f"wrote {out}")
    return 0 if all(ok for _, ok in verdict(result, args.plateau_mb)) else 1


if __name__ == "__main__":
    sys.exit(main())
