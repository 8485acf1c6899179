"""`Token`: a vocabulary entry that is both a byte string and a token id."""

import operator


def is_token(x) -> bool:
    """A token is ``bytes`` carrying an int ``token_id``: this module's Token, or
    another implementation's, such as genlm.backend's ``Token`` (a vocabulary built
    by genlm itself, or genlm modules imported before ``genlm_fast.dropin``)."""
    if isinstance(x, Token):
        return True
    return (  # plain bytes first: the common case, kept cheap
        type(x) is not bytes
        and isinstance(x, bytes)
        and isinstance(getattr(x, "token_id", None), int)
    )


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
