"""Loading and memory at the scale users run: genlm_fast's AsyncTransformer against
genlm-backend's on the same checkpoint, each in a fresh process.

    python -m bench.load_memory                          # Llama-3.2-1B architecture, bfloat16
    python -m bench.load_memory --model llama3.1-8b      # 16 GB of bfloat16 weights
    python -m bench.load_memory --dtype float32 --rounds 1 --out bench/results/x.md

Each run is a child process that loads the model as a user does (``from_name`` of the
checkpoint directory; genlm-backend's spelled out as its ``from_name`` does it), answers one
prompt (load-to-first-answer), then decodes: 16 particles sharing the prompt, for a few
rounds of one token each (``--decode-rounds``, an SMC step's LM calls), then runs the byte
beam (K=5) over a short prefill and a few bytes (``--beam-bytes``). It reports the wall time
of each phase, its resident memory after loading and after decoding, and its peak (VmHWM),
against the bytes of the model's weights. ``--libraries genlm_fast`` leaves genlm-backend out
(its bfloat16 decoding is slow at 8 B: a load-only run of it, ``--decode-rounds 0
--beam-bytes 0``, still gives its memory). Runs alternate between the libraries, round by
round, so that both see the same machine; the best round of each is reported (the page cache
holds the checkpoint after the first load: both read it from memory). Memory is counted
beyond the runtime: what the process holds before loading, transformers' code for the model
and its tokenizer included (imported first, its time counted in loading). The report names
each library's forward path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from bench.beams import advance, make_beam
from bench.machine import REPO, machine_line
from bench.report import command_line, write_report
from bench.workers import child_env

PROMPT = "In a quiet village at the edge of the forest, an old clockmaker"
BEAM_PREFILL = b"In a quiet village"
BEAM_BYTES = b" at the edge"  # the beam's steps: the first --beam-bytes of these
BEAM_K = 5
PARTICLES = 16
DECODE_ROUNDS = 2  # enough to see the key/value states and outputs settle in memory
LIBRARIES = ("genlm_fast", "genlm-backend")
MEMORY_KEYS = (
    "rss_loaded",
    "rss_decoded",
    "rss_beam",
    "peak",
)  # the table's resident memory columns


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


async def _beam(library, lm, steps):
    """The byte beam (K=5) over BEAM_PREFILL, then `steps` bytes of BEAM_BYTES."""
    beam = await make_beam("genlm_fast" if library == "genlm_fast" else "genlm", lm, BEAM_K)
    logp, _ = await advance(beam, BEAM_PREFILL, BEAM_BYTES[:steps])
    return logp


def _import_what_loading_imports(path):
    """The modules loading the checkpoint imports (transformers imports the model's and the
    tokenizer's code on first use: ~220 MB resident for Llama), so that the runtime's memory
    holds them; both libraries pay the time, counted in their loading."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    transformers.AutoModelForCausalLM._model_mapping[type(config)]  # (imports the class)
    transformers.PreTrainedTokenizerFast  # noqa: B018  (likewise)


def _child(library, path, dtype_name, decode_rounds, beam_bytes):
    """One run in this process: the measurements as a dict."""
    import torch
    import transformers  # noqa: F401  (imported before the runtime's memory is read)

    if library == "genlm_fast":
        from genlm_fast.backend.llm import AsyncTransformer
    else:
        import genlm.backend.llm as reference
        from transformers import AutoModelForCausalLM, AutoTokenizer
    dtype = getattr(torch, dtype_name)
    start = time.perf_counter()
    _import_what_loading_imports(path)
    rss_runtime = _status_bytes("VmRSS")  # the interpreter and the libraries, no model yet
    if library == "genlm_fast":
        lm = AsyncTransformer.from_name(path, hf_opts={"dtype": dtype})
    else:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, device_map="auto", dtype=dtype)
        lm = reference.AsyncTransformer(model, tok)
    loaded = time.perf_counter()
    prompt = lm.tokenizer.encode(PROMPT)
    first = lm.next_token_logprobs_sync(prompt)
    answered = time.perf_counter()
    rss_loaded = _status_bytes("VmRSS")
    gen = torch.Generator().manual_seed(0)
    particles = [list(prompt) for _ in range(PARTICLES)]
    rows = [first] * PARTICLES
    for _ in range(int(decode_rounds)):
        for p, row in zip(particles, rows):
            p.append(int(torch.multinomial(row.float().exp(), 1, generator=gen)))
        rows = lm.batch_next_token_logprobs_sync(particles)
    decoded = time.perf_counter()
    rss_decoded = _status_bytes("VmRSS")
    if int(beam_bytes) > 0:
        asyncio.run(_beam(library, lm, int(beam_bytes)))
    beamed = time.perf_counter()
    # genlm_fast: when loading's background work (the packed copy gathered into 2 MB pages,
    # beside the steps above) was done
    settled = None
    if hasattr(lm, "settle"):
        lm.settle()
        settled = time.perf_counter() - start
    weights = {id(p): p for p in lm.model.parameters()}.values()
    return {
        "library": library,
        "forward": getattr(lm, "forward_path", "transformers"),  # (genlm-backend's: its own)
        "load_s": loaded - start,
        "first_answer_s": answered - start,
        "decode_s": decoded - answered,
        "beam_s": beamed - decoded,
        "settled_s": settled,
        "weights_bytes": sum(p.numel() * p.element_size() for p in weights),
        "rss_runtime": rss_runtime,
        "rss_loaded": rss_loaded,
        "rss_decoded": rss_decoded,
        "rss_beam": _status_bytes("VmRSS"),
        "peak": _status_bytes("VmHWM"),
    }


def run_one(library, path, dtype_name, decode_rounds, beam_bytes):
    """One run in a fresh child process (its memory is its own)."""
    out = subprocess.run(
        [
            sys.executable,
            *("-m", "bench.load_memory", "--child", library, path, dtype_name),
            str(decode_rounds),
            str(beam_bytes),
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{library} run failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(model, dtype_name, runs, rounds, beam_bytes):
    libraries = [lib for lib in LIBRARIES if any(r["library"] == lib for r in runs)]
    best = {
        lib: min((r for r in runs if r["library"] == lib), key=lambda r: r["first_answer_s"])
        for lib in libraries
    }
    gb = 1e9
    lines = [
        f"{model}, {dtype_name}: best of {len(runs) // len(libraries)} alternating rounds per "
        "library",
        "",
        f"| library | load s | load-to-first-answer s | {PARTICLES} x {rounds} decode s "
        f"| beam K={BEAM_K}, {len(BEAM_PREFILL)}-byte prefill + {beam_bytes} bytes s "
        "| weights GB | runtime GB | resident after load | after decoding | after the beam "
        "| peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lib, r in best.items():
        w, base = r["weights_bytes"], r["rss_runtime"]
        held = [f"{r[k] / gb:.2f} GB ({(r[k] - base) / w:.2f}x)" for k in MEMORY_KEYS]
        lines.append(
            f"| {lib} | {r['load_s']:.1f} | {r['first_answer_s']:.1f} | {r['decode_s']:.1f} "
            f"| {r['beam_s']:.1f} | {w / gb:.2f} | {base / gb:.2f} | {' | '.join(held)} |"
        )
    forwards = ", ".join(f"{lib}: {r.get('forward', '?')}" for lib, r in best.items())
    lines += ["", f"Forward path: {forwards}."]
    settled = best.get("genlm_fast", {}).get("settled_s")
    if settled:
        lines += [
            "",
            f"genlm_fast's packed copy was on 2 MB pages (`settle()` returned) {settled:.1f} s "
            "after loading started, the steps above run meanwhile.",
        ]
    lines += [
        "",
        "(x: what the process holds beyond its runtime, the interpreter and libraries imported "
        "before loading (the model's and tokenizer's transformers code included), in units of "
        "the weights' bytes; load times include importing that code)",
    ]
    if len(best) == 2:
        fast, ref = best["genlm_fast"], best["genlm-backend"]
        first = fast["first_answer_s"] / ref["first_answer_s"]
        ratios = [f"load-to-first-answer: genlm_fast {first:.2f}x genlm-backend's"]
        for key, what in (("decode_s", "decoding"), ("beam_s", "the beam")):
            if fast[key] > 0 and ref[key] > 0:
                ratios.append(
                    f"{what}: genlm-backend {ref[key] / fast[key]:.2f}x genlm_fast's time"
                )
        lines += ["", "; ".join(ratios)]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3.2-1b", choices=("llama3.2-1b", "llama3.1-8b"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=2, help="runs of each library")
    parser.add_argument("--decode-rounds", type=int, default=DECODE_ROUNDS)
    parser.add_argument(
        "--beam-bytes", type=int, default=4, help="byte beam steps after the prefill"
    )
    parser.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    parser.add_argument("--out", help="also write the table to this Markdown file")
    parser.add_argument(
        "--child",
        nargs=5,
        metavar=("LIBRARY", "PATH", "DTYPE", "ROUNDS", "BEAM"),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    from genlm_fast.models import llama3_path

    path = llama3_path(args.model, dtype=args.dtype)
    runs = []
    for _ in range(args.rounds):
        for library in args.libraries:
            runs.append(run_one(library, path, args.dtype, args.decode_rounds, args.beam_bytes))
            print(json.dumps(runs[-1]), flush=True)
    command = command_line("bench.load_memory", argv)
    report = table(args.model, args.dtype, runs, args.decode_rounds, args.beam_bytes)
    text = f"{machine_line()}\n\n`{command}`\n\n{report}\n"
    write_report(text, args.out)


if __name__ == "__main__":
    main()
