"""`bench.programs`' own checks, which the genlm-control program tests rely on: the
constraint check reports what breaks a regular expression or a JSON schema (and exempts only
dead particles), and a program stops at the end tokens its LM's vocabulary has."""

from __future__ import annotations

import math
import types

from bench import programs
from bench.programs import Outcome, end_tokens, violations

REGEX = programs.BEST_REGEX  # \sthe\s(best|worst).*


def test_regex_violations_of_live_particles_are_reported():
    ok = Outcome([(b" the best city", -1.0), (b" the wor", -2.0)], constraint=("regex", REGEX))
    assert violations(ok) == [
        "b' the wor': finished with weight -2.0 but does not match '\\\\sthe\\\\s(best|worst).*'"
    ]
    bad = Outcome([(b" We", -0.5), (b"\xff", -0.5)], constraint=("regex", REGEX))
    found = violations(bad)
    assert len(found) == 2 and "not a prefix" in found[0] and "not UTF-8" in found[1]


def test_dead_particles_are_not_checked():
    dead = Outcome([(b" We", -math.inf), (b"\xff", -math.inf)], constraint=("regex", REGEX))
    assert violations(dead) == []


def test_json_violations():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    good = Outcome([(b'{"a": 3}', -1.0)], constraint=("json", schema))
    assert violations(good) == []
    bad = Outcome([(b'{"a": "x"}', -1.0), (b"{", -1.0)], constraint=("json", schema))
    assert len(violations(bad)) == 2
    assert violations(Outcome([(b"{", -1.0)])) == []  # no constraint, nothing to break


def test_end_tokens_are_the_vocabularys():
    smol = types.SimpleNamespace(byte_vocab=[b"a", b"<|im_end|>", b"<|endoftext|>"])
    llama = types.SimpleNamespace(
        byte_vocab=[types.SimpleNamespace(byte_string=b) for b in (b"<|eot_id|>", b"x")]
    )
    assert end_tokens(smol) == [b"<|im_end|>", b"<|endoftext|>"]
    assert end_tokens(smol, programs.TEXT_EOS) == [b"<|endoftext|>"]
    assert end_tokens(llama) == [b"<|eot_id|>"]
