"""genlm-control 0.4.1's own example programs, on a language model loaded once.

The programs are those a genlm user starts from: genlm-control's getting-started guide
(``docs/getting_started.md`` in its repository: a prompted LM sampled directly, the product
of two prompted LMs, that product constrained by a regular expression with AWRS), its README
(a regular expression and a JSON schema, each with AWRS) and its ``ByteLLM`` potential (the
docstring's prefix probability, and a byte-level AWRS run). They are written here as those
documents write them, with two changes only: the model is the one passed in (loaded once by
the caller, so that loading is never timed; the documents load it with ``from_name``), and
``verbosity`` is left at 0 (the README's 1 prints every particle at every step).

The LM must be genlm.backend's ``AsyncLM`` (the real package, or genlm_fast's under
``genlm_fast.dropin``); genlm-control is imported by the programs, so which implementation
runs is decided by whoever imported ``genlm_fast.dropin`` first.

    from bench.programs import PROGRAMS, load_lm, run_program
    llm = load_lm()                                # SmolLM2-135M-Instruct, the local copy
    outcome = asyncio.run(run_program("product_regex", llm, seed=0))

Each program returns an `Outcome`: the SMC particles (as byte strings and log weights) and
what is deterministic about the run (log probabilities the potentials give), with the
constraint each particle must satisfy. Every run is seeded first (`seed_everything`: torch,
numpy, ``random``, and AWRS's own ``seed``), so the two implementations follow the same
trajectory as long as their probabilities agree to within a draw's margin.
"""

from __future__ import annotations

import dataclasses
import json
import random

PROMPT_MTL = "Montreal is"
PROMPT_BOS = "Boston is"
BEST_REGEX = r"\sthe\s(best|worst).*"
README_REGEX = r" SMC is (🔥🔥|😍😍|🤌🤌) with LMs"

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {
            "type": "string",
            "enum": ["Alice", "Bob", "Charlie"],
            "description": "The name of the person",
        },
        "age": {
            "type": "integer",
            "minimum": 20,
            "maximum": 80,
            "description": "The age of the person",
        },
    },
}
BOOK_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "description": "The title of the book"},
        "pages": {
            "type": "integer",
            "minimum": 1,
            "maximum": 2000,
            "description": "The number of pages in the book",
        },
        "genre": {
            "type": "string",
            "enum": ["fiction", "non-fiction", "mystery"],
            "description": "The genre of the book",
        },
    },
}
# end-of-turn and end-of-text tokens: SmolLM2-Instruct's, Llama 3's (the README's model); a
# program takes those its LM's vocabulary has (`end_tokens`)
CHAT_EOS = [b"<|im_end|>", b"<|endoftext|>", b"<|eot_id|>", b"<|end_of_text|>"]
TEXT_EOS = [b"<|endoftext|>", b"<|end_of_text|>"]  # end of text only (the byte beam's)


def end_tokens(llm, candidates=CHAT_EOS) -> list[bytes]:
    """Those of ``candidates`` that are tokens of ``llm``'s vocabulary."""
    vocab = {bytes(getattr(token, "byte_string", token)) for token in llm.byte_vocab}
    return [t for t in candidates if t in vocab]


@dataclasses.dataclass
class Outcome:
    """What a program returned.

    Attributes:
        particles: each particle as its bytes (EOS dropped) and whether it ended in EOS
            (SMC appends EOS at ``max_tokens``, so all do), with its log weight.
        scores: deterministic log probabilities (name -> float) the program's potentials
            give (the ByteLLM prefix program's result; the target's ``prefix`` of a fixed
            context), to compare across implementations.
        constraint: ``None`` (none but the LM's own EOS), ``("regex", pattern)`` or
            ``("json", schema)``: what every particle with a finite weight satisfies.
    """

    particles: list = dataclasses.field(default_factory=list)  # (bytes, log_weight)
    scores: dict = dataclasses.field(default_factory=dict)
    constraint: tuple | None = None
    contexts: list = dataclasses.field(default_factory=list)  # the raw token contexts


def seed_everything(seed: int) -> None:
    """Seed every random source a program draws from: ``random``, numpy's global
    generator, torch's (AWRS also gets ``seed`` itself)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_lm(path: str | None = None):
    """The LM every program runs on: SmolLM2-135M-Instruct (local, float32), through
    genlm.backend's ``load_model_by_name`` (genlm_fast's when the drop-in is installed)."""
    from genlm.backend.llm import load_model_by_name

    if path is None:
        from genlm_fast.models import smollm2_path

        path = smollm2_path(quiet=True)
    llm = load_model_by_name(path, backend="hf")
    # loading's background work (genlm_fast gathers its packed weights into 2 MB pages) is
    # loading too, which the programs' timings leave out
    if hasattr(llm, "settle"):
        llm.settle()
    return llm


def _particles(sequences) -> tuple[list, list]:
    from genlm.control import EOS

    out = []
    for context, log_weight in zip(sequences.contexts, sequences.log_weights):
        tokens = list(context)
        ended = bool(tokens) and (tokens[-1] is EOS or tokens[-1] == EOS)
        if ended:
            tokens = tokens[:-1]
        text = b"".join(bytes(getattr(t, "byte_string", t)) for t in tokens)
        out.append((text, float(log_weight)))
    return out, [list(c) for c in sequences.contexts]


async def _scored(outcome, target, probe):
    """Add ``target.prefix(probe)`` to ``outcome.scores`` (probe: a token-level context)."""
    outcome.scores["prefix_probe"] = float(await target.prefix(probe))
    return outcome


# ---------------------------------------------------------------- the programs


async def basic(llm, seed):
    """Getting started, "Basic LLM Sampling": ``direct_token_sampler`` on a PromptedLLM."""
    from genlm.control import PromptedLLM, direct_token_sampler

    mtl_llm = PromptedLLM(llm, temperature=0.5, eos_byte_strings=[b"."])
    mtl_llm.set_prompt_from_str(PROMPT_MTL)
    token_sampler = direct_token_sampler(mtl_llm)
    sequences = await token_sampler.smc(n_particles=5, max_tokens=25, ess_threshold=0.0)
    particles, contexts = _particles(sequences)
    outcome = Outcome(particles, contexts=contexts)
    return await _scored(outcome, mtl_llm, mtl_llm.tokenize(" a city in Canada"))


def _product(llm):
    from genlm.control import PromptedLLM

    mtl_llm = PromptedLLM(llm, temperature=0.5, eos_byte_strings=[b"."])
    mtl_llm.set_prompt_from_str(PROMPT_MTL)
    bos_llm = mtl_llm.spawn()
    bos_llm.set_prompt_from_str(PROMPT_BOS)
    return mtl_llm, mtl_llm * bos_llm


async def product(llm, seed):
    """Getting started, "Prompt Intersection": the product of two prompted LLMs."""
    from genlm.control import direct_token_sampler

    mtl_llm, prod = _product(llm)
    token_sampler = direct_token_sampler(prod)
    sequences = await token_sampler.smc(n_particles=5, max_tokens=25, ess_threshold=0.5)
    particles, contexts = _particles(sequences)
    outcome = Outcome(particles, contexts=contexts)
    return await _scored(outcome, prod, mtl_llm.tokenize(" the best city"))


async def product_regex(llm, seed):
    """Getting started, "Adding Regex Constraints": the product, constrained by
    ``BoolFSA.from_regex(r"\\sthe\\s(best|worst).*")``, sampled with AWRS."""
    from genlm.control import AWRS, BoolFSA

    mtl_llm, prod = _product(llm)
    best_fsa = BoolFSA.from_regex(BEST_REGEX)
    coerced_fsa = best_fsa.coerce(prod, f=b"".join)
    token_sampler = AWRS(prod, coerced_fsa, seed=seed)
    sequences = await token_sampler.smc(n_particles=5, max_tokens=25, ess_threshold=0.5)
    particles, contexts = _particles(sequences)
    outcome = Outcome(particles, constraint=("regex", BEST_REGEX), contexts=contexts)
    return await _scored(outcome, prod, mtl_llm.tokenize(" the best city"))


def readme_regex_sampler(llm, seed):
    """`readme_regex` up to its SMC: the prompted LM and the AWRS sampler constrained by
    ``README_REGEX`` (run them with ``token_sampler.smc(**README_REGEX_SMC)``). Apart, so
    that the contention benchmark can time the SMC alone."""
    from genlm.control import AWRS, BoolFSA, PromptedLLM

    plm = PromptedLLM(llm)
    plm.set_prompt_from_str("Here is my honest opinion:")
    fsa = BoolFSA.from_regex(README_REGEX)
    coerced_fsa = fsa.coerce(plm, f=b"".join)
    return plm, AWRS(plm, coerced_fsa, seed=seed)


README_REGEX_SMC = {"n_particles": 10, "ess_threshold": 0.5, "max_tokens": 30, "verbosity": 0}


async def readme_regex(llm, seed):
    """README, "Controlling an LLM with a regular expression"."""
    plm, token_sampler = readme_regex_sampler(llm, seed)
    sequences = await token_sampler.smc(**README_REGEX_SMC)
    particles, contexts = _particles(sequences)
    outcome = Outcome(particles, constraint=("regex", README_REGEX), contexts=contexts)
    return await _scored(outcome, plm, plm.tokenize(" SMC is"))


async def json_schema(llm, seed):
    """README, "Controlling an LLM with a JSON schema" (SmolLM2-Instruct's chat template
    and end-of-turn tokens in place of Llama 3.2's)."""
    from genlm.control import AWRS, JsonSchema, PromptedLLM

    plm = PromptedLLM(llm, eos_byte_strings=end_tokens(llm), temperature=0.8)
    conversation = [
        {
            "role": "system",
            "content": "You need to generate a JSON object that matches "
            "the schema below. Only generate the JSON object on a single line with no "
            "other text.",
        },
        {"role": "user", "content": json.dumps(PERSON_SCHEMA)},
        {"role": "assistant", "content": '{"name": "Alice", "age": 30}'},
        {"role": "user", "content": json.dumps(BOOK_SCHEMA)},
    ]
    tokenizer = plm.model.tokenizer
    if getattr(tokenizer, "chat_template", None):
        plm.prompt_ids = tokenizer.apply_chat_template(
            conversation=conversation,
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
    else:  # a tokenizer without a chat template: the turns as plain lines
        text = "".join(f"{turn['role']}: {turn['content']}\n" for turn in conversation)
        plm.prompt_ids = tokenizer.encode(text + "assistant: ")
    schema_potential = JsonSchema(BOOK_SCHEMA)
    coerced_schema = schema_potential.coerce(plm, f=b"".join)
    token_sampler = AWRS(plm, coerced_schema, seed=seed)
    sequences = await token_sampler.smc(
        n_particles=2, ess_threshold=0.5, max_tokens=30, verbosity=0
    )
    particles, contexts = _particles(sequences)
    outcome = Outcome(particles, constraint=("json", BOOK_SCHEMA), contexts=contexts)
    return await _scored(outcome, plm, plm.tokenize('{"title": "'))


def _beam_params(llm):
    from genlm.bytes import BeamParams

    return BeamParams(K=5, eos_byte_strings=end_tokens(llm, TEXT_EOS), heal=True)


async def bytellm_prefix(llm, seed):
    """``ByteLLM``'s docstring: the log probability of the bytes " world" after "Hello"."""
    from genlm.control import ByteLLM

    async with ByteLLM(llm, _beam_params(llm)) as byte_llm:
        byte_llm.set_prompt_from_str("Hello")
        logp = await byte_llm.prefix([b" ", b"w", b"o", b"r", b"l", b"d"])
    return Outcome(scores={"prefix": float(logp)})


async def bytellm_awrs(llm, seed):
    """A byte-level AWRS run: ``ByteLLM`` (the docstring's beam) constrained by the
    getting-started regular expression."""
    from genlm.control import AWRS, BoolFSA, ByteLLM

    async with ByteLLM(llm, _beam_params(llm)) as byte_llm:
        byte_llm.set_prompt_from_str(PROMPT_MTL)
        best_fsa = BoolFSA.from_regex(BEST_REGEX)
        coerced_fsa = best_fsa.coerce(byte_llm, f=b"".join)
        token_sampler = AWRS(byte_llm, coerced_fsa, seed=seed)
        sequences = await token_sampler.smc(n_particles=5, max_tokens=20, ess_threshold=0.5)
        particles, contexts = _particles(sequences)
        outcome = Outcome(particles, constraint=("regex", BEST_REGEX), contexts=contexts)
        probe = [bytes([b]) for b in b" the best"]
        outcome.scores["prefix_probe"] = float(await byte_llm.prefix(probe))
    return outcome


PROGRAMS = {
    "basic": basic,
    "product": product,
    "product_regex": product_regex,
    "readme_regex": readme_regex,
    "json_schema": json_schema,
    "bytellm_prefix": bytellm_prefix,
    "bytellm_awrs": bytellm_awrs,
}


async def run_program(name: str, llm, seed: int = 0) -> Outcome:
    """Run program ``name`` on ``llm`` from a clean start: the LM's caches emptied (as a
    fresh process would have them) and every random source seeded with ``seed``."""
    llm.clear_cache()
    seed_everything(seed)
    return await PROGRAMS[name](llm, seed)


# ---------------------------------------------------------------- constraint checks


def violations(outcome: Outcome) -> list[str]:
    """Why particles of ``outcome`` break its constraint (empty when none does): a live
    particle (a finite weight) must spell a prefix of a match, and satisfy it whole where it
    ended. A dead one (weight -inf) is not checked: it holds whatever token its sampler drew
    when it rejected them all (AWRS). Checked with the ``regex`` package and ``json`` /
    ``jsonschema``, not with genlm-control's potentials."""
    import math

    problems = []
    if outcome.constraint is None:
        return problems
    kind, spec = outcome.constraint
    for text, log_weight in outcome.particles:
        if not math.isfinite(log_weight):
            continue
        if kind == "regex":
            import regex

            try:
                string = text.decode("utf-8")
            except UnicodeDecodeError:
                problems.append(f"{text!r}: not UTF-8")
                continue
            if not regex.fullmatch(spec, string, partial=True):
                problems.append(f"{text!r}: not a prefix of a match of {spec!r}")
            elif not regex.fullmatch(spec, string):
                problems.append(
                    f"{text!r}: finished with weight {log_weight} but does not match {spec!r}"
                )
        elif kind == "json":
            import jsonschema

            try:
                jsonschema.validate(json.loads(text), spec)
            except (ValueError, jsonschema.ValidationError) as error:
                problems.append(f"{text!r}: not a document of the schema ({error})")
    return problems
