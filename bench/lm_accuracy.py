"""How far `AsyncTransformer`'s next-token log-probabilities are from float64, per CPU linear
kernel.

    python -m bench.lm_accuracy [--contexts 80] [--kernels auto,torch,rows]

On the real SmolLM2-135M-Instruct: the same model in float64 (transformers, no cache) is
the oracle. Contexts: three of special tokens ([1..7], [1..16], [0, 0, 0]: large
activations that cancel), two text prompts, and ``--contexts`` random token-id contexts of
1-39 tokens (seed 0). For each kernel (``cpu_linear.pack_linear_layers``'s ``kernel``, one
child process each) the max abs error over the vocabulary of every context,
then the median, mean, 90th percentile and max over the contexts. A few random contexts
are ill-conditioned (float32 noise of any summation order grows to ~1e-3 there), so the
median and the 90th percentile say more about a kernel than the max.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np


def _contexts(tokenizer, count):
    rng = np.random.default_rng(0)
    out = [list(range(1, 8)), list(range(1, 17)), [0, 0, 0]]
    out += [
        tokenizer.encode(t)
        for t in (
            "The capital of France is",
            "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n",
        )
    ]
    out += [
        rng.integers(0, len(tokenizer), size=int(n)).tolist()
        for n in rng.integers(1, 40, size=count)
    ]
    return out


def _errors(count, kernel):
    """Errors of ``kernel``, one per context (runs in the child)."""
    import torch
    from transformers import AutoModelForCausalLM

    from genlm_fast.backend.llm import AsyncTransformer
    from genlm_fast.models import smollm2_path

    path = smollm2_path()
    lm = AsyncTransformer.from_name(path, cpu_linear=kernel)
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    errors = []
    for ctx in _contexts(lm.tokenizer, count):
        with torch.no_grad():
            want = torch.log_softmax(oracle(torch.tensor([ctx])).logits[0, -1], -1)
        got = lm.next_token_logprobs_sync(ctx).double()
        errors.append(float((got - want).abs().max()))
    lm.cleanup()
    return errors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, default=80, help="random contexts")
    parser.add_argument(
        "--kernels",
        default="auto,torch,rows",
        help="CPU linear kernels (auto, avx512, rows, torch), comma-separated",
    )
    parser.add_argument("--child", metavar="KERNEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_errors(args.contexts, args.child)))
        return
    print("| kernel | contexts | median | mean | p90 | max | [1..7] | [1..16] | [0, 0, 0] |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kernel in args.kernels.split(","):
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.lm_accuracy",
                "--child",
                kernel,
                "--contexts",
                str(args.contexts),
            ],
            env=env,
            text=True,
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0:
            print(f"| {kernel} | failed: {proc.stderr.strip().splitlines()[-1]} |")
            continue
        e = np.array(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(
            f"| {kernel} | {len(e)} | {np.median(e):.2e} | {e.mean():.2e} | "
            f"{np.quantile(e, 0.9):.2e} | {e.max():.2e} | "
            + " | ".join(f"{x:.1e}" for x in e[:3])
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
