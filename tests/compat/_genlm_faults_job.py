"""Faults in genlm-control programs on genlm_fast (used by test_genlm_control_faults.py).

    python tests/compat/_genlm_faults_job.py OUT.json

Runs under ``genlm_fast.dropin`` in its own interpreter (genlm-control imports
genlm.backend / genlm.bytes, which must resolve to genlm_fast). On SmolLM2, with the
programs of `bench.programs`:

- ``raising_potential``: the getting-started product, constrained by a potential that
  raises on its 5th call (as AWRS's condition);
- ``cancelled``: a token-level (README regex) and a byte-level (ByteLLM AWRS) run, each
  cancelled once the LM has answered a few batches;
- ``closed``: the same two runs on a second model sharing the first one's weights, closed
  (``cleanup``) while they run.

For each: what the caller got (the exception's type and message), how long it took to
get it (a hang shows as the ``WAIT`` timeout), whether the LM's queue was empty afterwards
(for ``closed``: the closed model's queue and the first model's, both), and whether the
model (for ``closed``: the first model, which shares the weights) still gives exactly the
clean run's result: the getting-started regex program is run once before any fault and
once after each, seeded alike. Written to OUT.json.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

WAIT = 120.0  # seconds: far beyond any of these runs; reaching it means a hang
CHECK = "product_regex"


def _fingerprint(outcome):
    return {"particles": [[t.hex(), w] for t, w in outcome.particles], "scores": outcome.scores}


async def _after_batches(llm, n):
    start = llm.stats["batches"]
    while llm.stats["batches"] < start + n:
        await asyncio.sleep(0.005)


async def _caught(awaitable):
    """(error type name, message, seconds) of what ``awaitable`` raised (None if nothing)."""
    start = time.perf_counter()
    try:
        await asyncio.wait_for(awaitable, WAIT)
    except asyncio.TimeoutError:
        return {"error": "TIMEOUT", "seconds": time.perf_counter() - start}
    except (Exception, asyncio.CancelledError) as error:  # noqa: BLE001 - reported
        return {
            "error": type(error).__name__,
            "message": str(error)[:300],
            "seconds": time.perf_counter() - start,
        }
    return {"error": None, "seconds": time.perf_counter() - start}


async def main():
    # isort: off
    import genlm_fast.dropin  # noqa: F401  (before genlm.control imports genlm.backend)
    from genlm.control import AWRS, Potential
    # isort: on

    from bench import programs as P
    from genlm_fast.backend.llm import AsyncTransformer

    llm = P.load_lm()
    result = {"backend": type(llm).__module__}
    clean = _fingerprint(await P.run_program(CHECK, llm, 0))
    result["clean"] = clean

    async def usable(model):
        await asyncio.sleep(0.05)  # let cancelled callers unwind
        pending = len(model.queries)
        again = _fingerprint(await P.run_program(CHECK, model, 0))
        return {"pending_after": pending, "same_as_clean": again == clean}

    # a potential that raises
    class Exploding(Potential):
        def __init__(self, after):
            super().__init__(vocabulary=list(range(256)))
            self.calls, self.after = 0, after

        def _tick(self):
            self.calls += 1
            if self.calls >= self.after:
                raise RuntimeError("the condition broke")

        async def prefix(self, context):
            self._tick()
            return 0.0

        async def complete(self, context):
            self._tick()
            return 0.0

    async def raising():
        llm.clear_cache()
        P.seed_everything(0)
        _, prod = P._product(llm)
        sampler = AWRS(prod, Exploding(after=5).coerce(prod, f=b"".join), seed=0)
        await sampler.smc(n_particles=5, max_tokens=25, ess_threshold=0.5)

    result["raising_potential"] = await _caught(raising())
    result["raising_potential"].update(await usable(llm))

    # a cancelled run
    for program in ("readme_regex", "bytellm_awrs"):
        task = asyncio.ensure_future(P.run_program(program, llm, 0))
        await _after_batches(llm, 3)
        task.cancel()
        caught = await _caught(task)
        caught.update(await usable(llm))
        result[f"cancelled_{program}"] = caught

    # a model closed under a running sampler (a second model over the same weights)
    for program in ("readme_regex", "bytellm_awrs"):
        other = AsyncTransformer(llm.model, llm.tokenizer)
        task = asyncio.ensure_future(P.run_program(program, other, 0))
        await _after_batches(other, 3)
        other.cleanup()
        caught = await _caught(task)
        await asyncio.sleep(0.05)  # let the cancelled callers unwind
        caught["closed_pending_after"] = len(other.queries)  # the closed model's own queue
        caught.update(await usable(llm))  # the first model's queue, and its answers
        result[f"closed_{program}"] = caught
    return result


if __name__ == "__main__":
    out = asyncio.run(main())
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
