"""`Token`: a vocabulary entry that is both a byte string and a token id."""

import operator

# genlm-backend's own Token, known by where it is defined: a vocabulary built by genlm
# itself, or by genlm modules imported before genlm_fast.dropin
_GENLM_TOKEN = ("genlm.backend.tokenization.token", "Token")


def is_token(x) -> bool:
    """Whether ``x`` is a Token: this module's, or genlm-backend's (or a subclass of
    either). Tokens compare, hash and sort by id among themselves. Anything else, a bytes
    subclass that happens to carry a ``token_id`` included, is bytes, as it is for genlm."""
    cls = type(x)
    verdict = _IS_TOKEN_CLASS.get(cls)
    if verdict is None:  # a class met for the first time: walk its bases once
        verdict = _IS_TOKEN_CLASS[cls] = issubclass(cls, Token) or any(
            (c.__module__, c.__qualname__) == _GENLM_TOKEN for c in cls.__mro__
        )
    return verdict


def _by_id(op):
    """Build a rich comparison that orders Tokens by id.

    Against anything that is not a token it returns NotImplemented, so Python
    falls back to the other operand (for plain bytes: a content comparison).
    """

    def compare(self, other):
        if is_token(other):
            return op(self.token_id, other.token_id)
        return NotImplemented

    compare.__name__ = f"__{op.__name__}__"
    return compare


class Token(bytes):
    """The bytes of one vocabulary entry, tagged with its ``token_id``.

    Being a ``bytes`` subclass, a Token works wherever bytes do
    (``b"".join``, ``len``, slicing, ``.decode()``). Two Tokens are equal,
    hash and sort by ``token_id`` alone, since distinct ids may share the
    same bytes.
    """

    def __new__(cls, token_id: int, byte_string: bytes):
        if not isinstance(token_id, int):
            raise TypeError(f"token_id must be an int, got {type(token_id)}")
        if not isinstance(byte_string, bytes):
            raise TypeError(f"byte_string must be bytes, got {type(byte_string)}")
        self = super().__new__(cls, byte_string)
        self.token_id = token_id
        return self

    @property
    def byte_string(self) -> bytes:
        """The content as a plain ``bytes`` object."""
        return bytes(self)

    def __repr__(self):
        return f"Token(token_id={self.token_id}, byte_string={bytes(self)!r})"

    def __hash__(self):
        return hash(self.token_id)

    __eq__ = _by_id(operator.eq)
    __ne__ = _by_id(operator.ne)
    __lt__ = _by_id(operator.lt)
    __le__ = _by_id(operator.le)
    __gt__ = _by_id(operator.gt)
    __ge__ = _by_id(operator.ge)

    def __reduce__(self):
        return (Token, (self.token_id, bytes(self)))

    @staticmethod
    def as_bytes(x):
        """Plain bytes of a Token; any other value is returned unchanged."""
        return bytes(x) if is_token(x) else x

    @staticmethod
    def is_plain_bytes(x) -> bool:
        """True for a ``bytes`` object that is not a Token."""
        return isinstance(x, bytes) and not is_token(x)


# type -> whether its instances are Tokens (see `is_token`), filled as classes are met;
# the usual other operands are answered from the start
_IS_TOKEN_CLASS = {bytes: False, str: False, type(None): False, Token: True}
