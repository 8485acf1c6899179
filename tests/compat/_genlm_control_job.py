"""One genlm-control run on SmolLM2, in its own interpreter (used by test_genlm_control.py).

    python tests/compat/_genlm_control_job.py OUT_DIR [--dropin] [--score FILE]

Without ``--dropin`` genlm-control runs on the real genlm-backend / genlm-bytes packages;
with it, ``genlm_fast.dropin`` is imported first, so genlm-control's ``genlm.backend`` /
``genlm.bytes`` imports resolve to genlm_fast. The run writes ``OUT_DIR/result.json`` and
the full next-token weight vectors as ``OUT_DIR/*.npy``:

- token level (``PromptedLLM``): ``logw_next`` along a greedy decode of a few tokens, a
  ``batch_logw_next`` of two contexts, ``prefix``/``complete`` of the greedy sequence, and
  an SMC run of the AWRS token sampler constrained by a regular expression (``BoolFSA``);
- byte level (``ByteLLM``, genlm-bytes' beam): the same, one byte at a time.

``--score FILE`` (a previous run's ``result.json``) additionally scores that run's SMC
particles here with ``prefix``/``complete``, so one implementation checks the other's samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

PROMPT = "The capital of France is"
TOKEN_REGEX = r" (Paris|Lyon|Nice)"  # " Paris" is one SmolLM2 token
TOKEN_STEPS = 3
BYTE_REGEX = r" (Paris|Nice)"
BYTE_STEPS = 3
BEAM_K = 3
SEED = 1234


def _hex(token) -> str:
    """A token as hex (``Token`` objects by their bytes); genlm-control's EOS as "EOS"."""
    from genlm.control import EOS

    if token is EOS or token == EOS:
        return "EOS"
    return bytes(getattr(token, "byte_string", token)).hex()


def _context_key(context) -> list[str]:
    return [_hex(t) for t in context]


async def _greedy(potential, steps, out_dir, tag):
    """``steps`` argmax extensions; every ``logw_next`` vector is saved as tag_<i>.npy."""
    import numpy as np

    context, record = [], []
    for i in range(steps):
        weights = await potential.logw_next(context)
        vector = np.asarray(weights.weights, dtype=np.float64)
        np.save(os.path.join(out_dir, f"{tag}_{i}.npy"), vector)
        best = int(np.argmax(vector))
        token = weights.decode[best]
        record.append({"token": _hex(token), "logw": float(vector[best])})
        if _hex(token) == "EOS":
            break
        context.append(token)
    return context, record


async def _score(potential, contexts):
    """``prefix`` (or ``complete`` for an EOS-terminated context) of each hex-coded context."""
    scores = []
    for hex_context in contexts:
        done = bool(hex_context) and hex_context[-1] == "EOS"
        context = [bytes.fromhex(h) for h in (hex_context[:-1] if done else hex_context)]
        score = await (potential.complete(context) if done else potential.prefix(context))
        scores.append(float(score))
    return scores


async def _smc(sampler, n_particles, max_tokens):
    import numpy as np

    sequences = await sampler.smc(
        n_particles=n_particles, ess_threshold=0.5, max_tokens=max_tokens, verbosity=0
    )
    return {
        "contexts": [_context_key(c) for c in sequences.contexts],
        "log_weights": [float(w) for w in np.asarray(sequences.log_weights)],
    }


async def token_level(llm, out_dir, to_score):
    from genlm.control import AWRS, BoolFSA, PromptedLLM

    potential = PromptedLLM(llm)
    potential.set_prompt_from_str(PROMPT)
    context, greedy = await _greedy(potential, TOKEN_STEPS, out_dir, "token")
    batch = await potential.batch_logw_next([[], context[:1]])
    import numpy as np

    np.save(os.path.join(out_dir, "token_batch.npy"), np.asarray(batch.weights, np.float64))
    fsa = BoolFSA.from_regex(TOKEN_REGEX)
    sampler = AWRS(potential, fsa.coerce(potential, f=b"".join))
    smc = await _smc(sampler, n_particles=3, max_tokens=3)
    result = {
        "eos": potential.eos_byte_strings[0].hex(),
        "greedy": greedy,
        "greedy_prefix": float(await potential.prefix(context)),
        "greedy_complete": float(await potential.complete(context)),
        "smc": smc,
        "smc_scores": await _score(potential, smc["contexts"]),
    }
    if to_score is not None:
        result["other_smc_scores"] = await _score(potential, to_score["token"]["smc"]["contexts"])
    return result


async def byte_level(llm, out_dir, to_score):
    from genlm.bytes import BeamParams
    from genlm.control import AWRS, BoolFSA, ByteLLM

    eos = llm.byte_vocab[llm.tokenizer.eos_token_id].byte_string
    params = BeamParams(K=BEAM_K, prune_threshold=0.0, eos_byte_strings=[eos], heal=True)
    async with ByteLLM(llm, params) as potential:
        potential.set_prompt_from_str(PROMPT)
        context, greedy = await _greedy(potential, BYTE_STEPS, out_dir, "byte")
        result = {
            "greedy": greedy,
            "greedy_prefix": float(await potential.prefix(context)),
            "greedy_complete": float(await potential.complete(context)),
        }
        fsa = BoolFSA.from_regex(BYTE_REGEX)
        sampler = AWRS(potential, fsa.coerce(potential, f=b"".join))
        result["smc"] = await _smc(sampler, n_particles=2, max_tokens=7)
        result["smc_scores"] = await _score(potential, result["smc"]["contexts"])
        if to_score is not None:
            result["other_smc_scores"] = await _score(
                potential, to_score["byte"]["smc"]["contexts"]
            )
    return result


async def main(out_dir, dropin, to_score):
    """Both levels on SmolLM2; returns the result (``to_score``: a previous result or None)."""
    if dropin:
        import genlm_fast.dropin  # noqa: F401  (before genlm.control imports genlm.backend)
    import genlm.bytes

    from bench.programs import load_lm, seed_everything

    seed_everything(SEED)
    seconds = {}
    start = time.perf_counter()
    llm = load_lm()
    seconds["load"] = time.perf_counter() - start
    result = {
        "backend_module": type(llm).__module__,
        "bytes_module": genlm.bytes.ByteBeamState.__module__,
    }
    for level, run in (("token", token_level), ("byte", byte_level)):
        start = time.perf_counter()
        result[level] = await run(llm, out_dir, to_score)
        seconds[level] = time.perf_counter() - start
    result["seconds"] = seconds
    print("seconds:", {k: round(v, 1) for k, v in seconds.items()}, file=sys.stderr)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--dropin", action="store_true")
    parser.add_argument("--score")
    args = parser.parse_args()
    previous = None
    if args.score:
        with open(args.score) as f:
            previous = json.load(f)
    result = asyncio.run(main(args.out_dir, args.dropin, previous))
    with open(os.path.join(args.out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
