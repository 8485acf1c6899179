"""The workloads of `bench.contention`, and the worker process that hosts them.

Workloads (each: genlm_fast, and the reference on the same inputs):

* ``trie-sum-B1``, ``trie-sum-B32``: ``batch_weight_sum`` on the Llama-3 vocabulary (128,256
  tokens) at B=1 and B=32: genlm_fast's ``ParallelTokenCharacterTrie`` (float32) against
  genlm-backend's numba ``TokenCharacterTrie``, both fed the same probabilities.
* ``lm-step``: one 16-row step of ``AsyncTransformer`` on SmolLM2-135M-Instruct, as SMC drives
  it: 16 concurrent ``next_token_logprobs`` calls, auto-batched into one forward (default
  batching settings: genlm-backend's batch waits its 20 ms timeout, genlm_fast's runs when
  the event loop idles), for contexts whose prompts were evaluated before, each extended by 3
  fresh random tokens (no output-cache hits; genlm_fast reuses the prompts' key/value states,
  genlm-backend runs the whole contexts).
* ``beam``: the byte-level beam (K=5) on SmolLM2: prefill a 10-byte prompt, then 5 bytes with
  ``logp_next`` before each; cold LM caches (built, untimed, before each call);
  genlm_fast.bytes against genlm-bytes on genlm-backend.
* ``control``: genlm-control's README program of `bench.programs` (``readme_regex``: a
  ``PromptedLLM`` constrained by a regular expression through ``BoolFSA``, the AWRS sampler,
  SMC with 10 particles and at most 30 tokens; its SMC timed, from cold caches and fixed
  seeds), on genlm_fast through ``genlm_fast.dropin`` and on the real genlm-backend.

Each implementation runs in a worker of its own (``python -m bench.contention_workloads
--worker <side>``, the protocol of `bench.workers`; the drop-in's import hook must not meet
the real packages), hosting all its workloads: ``setup`` builds and warms them, ``block``
runs one block of calls and returns their times.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.beams import advance, beam_maker  # noqa: E402 (after the checkout's path)
from bench.programs import (  # noqa: E402
    README_REGEX_SMC,
    readme_regex_sampler,
    seed_everything,
)
from bench.workers import serve  # noqa: E402

WORKLOADS = ("trie-sum-B1", "trie-sum-B32", "lm-step", "beam", "control")
SIDES = ("genlm_fast", "reference")

LM_ROWS = 16
LM_NEW_TOKENS = 3
BEAM_PROMPT = b"The sky is"
BEAM_BYTES = b" blue"
BEAM_K = 5
SEED = 1234


class Workload:
    """``start`` runs (untimed) before each block of calls, ``prepare`` before each call;
    ``call`` is the timed unit of work."""

    def start(self):
        pass

    def prepare(self):
        pass

    def call(self):
        raise NotImplementedError


class TrieSum(Workload):
    def __init__(self, side, batch):
        from bench.tries import build_fast, build_reference, make_inputs, ref_tokens
        from bench.vocabs import load_vocab

        _, vocab = load_vocab("llama3")
        if side == "genlm_fast":
            trie = build_fast(vocab, "parallel")
        else:
            trie = build_reference(ref_tokens(vocab), "numba")
        _, self.probs = make_inputs(len(vocab), batch)
        self.fn = trie.batch_weight_sum
        self.trie = trie

    def call(self):
        self.fn(self.probs)


class Models:
    """One SmolLM2 per worker, shared by the LM workloads, and the worker's event loop."""

    def __init__(self, side):
        from genlm_fast.models import smollm2_path

        self.side = side
        self.path = smollm2_path()
        self.loop = asyncio.new_event_loop()
        self._lm = None

    @property
    def lm(self):
        if self._lm is None:
            if self.side == "genlm_fast":
                from genlm_fast.backend.llm import AsyncTransformer

                self._lm = AsyncTransformer.from_name(self.path)
            else:
                from genlm.backend import llm
                from transformers import AutoModelForCausalLM, AutoTokenizer

                # genlm-backend's from_name, spelled out for a local directory
                tok = AutoTokenizer.from_pretrained(self.path)
                model = AutoModelForCausalLM.from_pretrained(self.path, dtype="auto")
                self._lm = llm.AsyncTransformer(model, tok)
        return self._lm

    def run(self, coro):
        return self.loop.run_until_complete(coro)


class LMStep(Workload):
    def __init__(self, models):
        self.models = models
        self.lm = models.lm
        tok = self.lm.tokenizer
        self.prompts = [tok.encode(f"Note {i}: the weather today is") for i in range(LM_ROWS)]
        self.rng = random.Random(SEED)

    def start(self):
        # the prompts evaluated (genlm_fast keeps their key/value states)
        self.lm.clear_cache()
        self.lm.batch_next_token_logprobs_sync(self.prompts)

    def prepare(self):
        self.contexts = [
            p + [self.rng.randrange(1000, 40000) for _ in range(LM_NEW_TOKENS)]
            for p in self.prompts
        ]

    def call(self):
        async def step(contexts):
            return await asyncio.gather(*(self.lm.next_token_logprobs(c) for c in contexts))

        self.models.run(step(self.contexts))


class Beam(Workload):
    def __init__(self, models, side):
        self.models = models
        library = "genlm_fast" if side == "genlm_fast" else "genlm"
        self.make_beam = beam_maker(library, models.lm, BEAM_K)

    def prepare(self):
        self.models.lm.clear_cache()
        self.beam = self.models.run(self.make_beam())

    def call(self):
        self.models.run(advance(self.beam, BEAM_PROMPT, BEAM_BYTES))


class Control(Workload):
    """genlm-control's README program (`bench.programs.readme_regex`): its SMC is the
    timed call; the sampler is built before each call, so that every call starts from the
    same seeds."""

    def __init__(self, models):
        self.models = models

    def prepare(self):
        self.models.lm.clear_cache()
        seed_everything(SEED)
        _, self.sampler = readme_regex_sampler(self.models.lm, SEED)

    def call(self):
        self.models.run(self.sampler.smc(**README_REGEX_SMC))


def _build(name, side, models):
    if name.startswith("trie-sum-B"):
        return TrieSum(side, int(name.removeprefix("trie-sum-B")))
    if name == "lm-step":
        return LMStep(models)
    if name == "beam":
        return Beam(models, side)
    if name == "control":
        return Control(models)
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def _block(work, seconds, min_calls):
    """Calls of ``work`` until ``seconds`` of them ran and at least ``min_calls``; their
    times."""
    work.start()
    times = []
    while len(times) < min_calls or sum(times) < seconds:
        work.prepare()
        t = time.perf_counter()
        work.call()
        times.append(time.perf_counter() - t)
    return times


def worker(side):
    """Serve the driver (`bench.workers.serve`): ``setup`` builds and warms the workloads,
    ``block`` runs one block of calls and returns their times."""
    import warnings

    warnings.simplefilter("ignore")
    if side == "genlm_fast":
        import genlm_fast.dropin  # noqa: F401  (genlm-control's genlm imports -> genlm_fast)
    models = Models(side)
    works = {}

    def handle(msg):
        if msg["cmd"] == "setup":
            for name in msg["workloads"]:
                works[name] = _build(name, side, models)
                _block(works[name], 0.0, 1)  # warm-up
            return {"info": _threads_info()}
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(msg.get("threads") or threads)
        try:
            times = _block(works[msg["workload"]], msg["seconds"], msg["min_calls"])
            info = _threads_info()  # what the block ran with
        finally:
            torch.set_num_threads(threads)
        return {"times": times, "info": info}

    serve(handle)


def _threads_info():
    import torch

    from genlm_fast.backend.llm.threads import threads_info

    info = threads_info() or {}
    info["torch_threads"] = torch.get_num_threads()
    return info


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m bench.contention_workloads",
        description="a worker of bench.contention (the driver starts it)",
    )
    parser.add_argument("--worker", choices=SIDES, required=True)
    worker(parser.parse_args(argv).worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
