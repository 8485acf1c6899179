"""genlm_fast's Token (genlm_fast.backend.tokenization.Token) against genlm-backend 0.3.1's:
comparisons, hashing, bytes behaviour, pickling and type errors, on generated ids and
contents (hypothesis), and the two meeting when genlm's modules were imported before the
drop-in."""

import copy
import operator
import pickle

import genlm.backend.tokenization as ref
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_fast.backend.tokenization import Token

ids = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.integers(min_value=-(2**70), max_value=2**70),
)
contents = st.binary(max_size=4)


@settings(max_examples=200, deadline=None)
@given(ids, contents, ids, contents)
def test_token_comparisons_follow_ids(i, a, j, b):
    x, y = Token(i, a), Token(j, b)
    assert (x == y) == (i == j)
    assert (x != y) == (i != j)
    assert (x < y) == (i < j)
    assert (x <= y) == (i <= j)
    assert (x > y) == (i > j)
    assert (x >= y) == (i >= j)
    if i == j:
        assert hash(x) == hash(y)


def test_tokens_hold_no_more_objects_than_genlms():
    """Every trie and potential keeps a vocabulary of Tokens, and the collector's full passes
    walk every tracked object: ours adds no more of them per token than genlm's Token. (A
    bound method kept per token, for a hash without a Python frame, triples them: a full
    collection with a Llama-3 vocabulary alive then takes 3.7x as long.)"""
    import gc

    def tracked(cls):
        gc.collect()
        gc.disable()  # no collection in between: it would free unrelated objects
        try:
            before = len(gc.get_objects())
            kept = [cls(i, b"t%d" % i) for i in range(1000)]
            added = len(gc.get_objects()) - before
        finally:
            gc.enable()
        del kept
        return added

    # (a few objects of slack for the interpreter's own; one more per token is 1000 more)
    assert tracked(Token) <= tracked(ref.Token) + 10


@settings(max_examples=200, deadline=None)
@given(ids, contents, contents)
def test_token_behaves_like_reference(i, a, b):
    """Against plain bytes (and in repr/hash) Token matches genlm's Token."""
    ours, theirs = Token(i, a), ref.Token(i, a)
    assert repr(ours) == repr(theirs)
    assert hash(ours) == hash(theirs)
    for op in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
        assert getattr(ours, op)(b) == getattr(theirs, op)(b)
    assert (ours == b) == (theirs == b) == (a == b)
    assert (ours < b) == (theirs < b) == (a < b)
    assert (b >= ours) == (b >= theirs) == (b >= a)
    assert Token.as_bytes(ours) == ref.Token.as_bytes(theirs)
    assert Token.is_plain_bytes(ours) == ref.Token.is_plain_bytes(theirs)
    assert Token.is_plain_bytes(b) == ref.Token.is_plain_bytes(b)


def test_token_bytes_behaviour():
    a, b = Token(7, b"ab"), Token(8, b"cd")
    assert b"".join([a, b, b"!"]) == b"abcd!"
    assert len(a) == 2 and a[0] == ord("a") and a[1:] == b"b"
    assert a.decode() == "ab"
    assert type(a.byte_string) is bytes and a.byte_string == b"ab"
    assert type(Token.as_bytes(a)) is bytes
    assert Token.as_bytes("text") == "text"
    assert Token.is_plain_bytes(b"ab") and not Token.is_plain_bytes(a)
    assert not Token.is_plain_bytes(bytearray(b"ab"))
    assert a.token_id == 7


def test_token_same_bytes_different_ids():
    x, y = Token(1, b"a"), Token(2, b"a")
    assert x != y and not (x == y)
    assert len({x, y}) == 2
    assert {x: 1, y: 2}[Token(1, b"zzz")] == 1
    assert sorted([y, x]) == [x, y]
    assert x == b"a" and b"a" == y  # plain bytes still compare by content


@pytest.mark.parametrize("token", [Token(0, b""), Token(5, b"\xff\x00"), Token(-3, b"x")])
def test_token_pickle_and_copy(token):
    for clone in (
        pickle.loads(pickle.dumps(token)),
        copy.deepcopy(token),
        copy.copy(token),
    ):
        assert type(clone) is Token
        assert clone.token_id == token.token_id
        assert bytes(clone) == bytes(token)
        assert clone == token


@pytest.mark.parametrize(
    "args",
    [("1", b"x"), (1.0, b"x"), (None, b"x"), (1, "x"), (1, bytearray(b"x")), (1, None)],
)
def test_token_type_errors(args):
    with pytest.raises(TypeError):
        ref.Token(*args)
    with pytest.raises(TypeError, match="token_id|byte_string"):
        Token(*args)


class _IdBytes(bytes):
    """A bytes subclass with a token_id attribute: bytes, not a Token, for genlm."""

    def __new__(cls, data, token_id):
        self = super().__new__(cls, data)
        self.token_id = token_id
        return self


@pytest.mark.parametrize("other", [_IdBytes(b"a", 2), _IdBytes(b"b", 1), _IdBytes(b"a", True)])
def test_token_against_bytes_with_a_token_id_attribute(other):
    """Compared, hashed and converted as genlm's Token does: by content, both ways round."""
    ours, theirs = Token(1, b"a"), ref.Token(1, b"a")
    for x, y in ((ours, other), (other, ours)):
        for op in (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge):
            expected = op(theirs, other) if x is ours else op(other, theirs)
            assert op(x, y) == expected == op(bytes(x), bytes(y)), (op, x, y)
    assert Token.is_plain_bytes(other) == ref.Token.is_plain_bytes(other) is True
    assert Token.as_bytes(other) is ref.Token.as_bytes(other) is other


def test_token_accepts_what_reference_accepts():
    # bool is an int subclass; genlm accepts it, and so do we.
    assert Token(True, b"x").token_id == ref.Token(True, b"x").token_id == 1


OPS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")


def _cmp(x, op, y):
    return {
        "__eq__": lambda: x == y,
        "__ne__": lambda: x != y,
        "__lt__": lambda: x < y,
        "__le__": lambda: x <= y,
        "__gt__": lambda: x > y,
        "__ge__": lambda: x >= y,
    }[op]()


@settings(max_examples=200, deadline=None)
@given(ids, contents, ids, contents)
def test_token_interoperates_with_genlm_token(i, a, j, b):
    """Our Token meets genlm's Token when genlm modules were imported before
    the drop-in: they must compare (and hash, and key dicts) by id exactly as two
    genlm Tokens do, in both operand orders."""
    for op in OPS:
        expected = _cmp(ref.Token(i, a), op, ref.Token(j, b))
        assert _cmp(Token(i, a), op, ref.Token(j, b)) == expected, op
        assert _cmp(ref.Token(i, a), op, Token(j, b)) == expected, op
    if i == j:
        assert hash(Token(i, a)) == hash(ref.Token(j, b))
        assert Token(i, a) in {ref.Token(j, b)} and ref.Token(j, b) in {Token(i, a)}
    theirs = ref.Token(j, b)
    assert Token.is_plain_bytes(theirs) == ref.Token.is_plain_bytes(theirs)
    assert type(Token.as_bytes(theirs)) is type(ref.Token.as_bytes(theirs)) is bytes
