"""Byte and string views of a Hugging Face tokenizer's vocabulary."""

from .bytes import ByteVocabError, _name, get_byte_vocab
from .token import Token

_FALLBACKS = ("tokenizer", "latin1", "replace")


def decode_vocab(tokenizer, byte2str_fallback="tokenizer"):
    """Return ``(byte_vocab, str_vocab)`` for ``tokenizer``.

    ``byte_vocab[i]`` is ``Token(i, bytes of token i)``; the bytes are the
    canonical form. ``str_vocab[i]`` is those bytes decoded as UTF-8, or, for
    tokens that are not valid UTF-8, a string chosen by ``byte2str_fallback``:

    - ``"tokenizer"``: the tokenizer's own token string,
    - ``"latin1"``: the bytes decoded as Latin-1,
    - ``"replace"``: UTF-8 decoding with U+FFFD for invalid sequences.

    Raises:
        ValueError: unknown ``byte2str_fallback``, or a tokenizer whose byte
            encoding cannot be recovered (chained from ByteVocabError).
    """
    _check_fallback(byte2str_fallback)
    try:
        raw = get_byte_vocab(tokenizer)
    except ByteVocabError as e:
        raise ValueError(
            "Could not decode byte representation of the token vocabulary "
            f"of tokenizer {_name(tokenizer)}"
        ) from e
    byte_vocab = [Token(i, b) for i, b in enumerate(raw)]
    return byte_vocab, bytes_to_strs(tokenizer, raw, byte2str_fallback)


def bytes_to_strs(tokenizer, byte_vocab, byte2str_fallback):
    """Decode each entry of ``byte_vocab`` (see `decode_vocab` for the modes)."""
    _check_fallback(byte2str_fallback)
    strs = []
    for i, raw in enumerate(byte_vocab):
        try:
            strs.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            if byte2str_fallback == "latin1":
                strs.append(raw.decode("latin1"))
            elif byte2str_fallback == "replace":
                strs.append(raw.decode("utf-8", errors="replace"))
            else:
                strs.append(tokenizer.convert_ids_to_tokens(i))
    return strs


def _check_fallback(mode):
    if mode not in _FALLBACKS:
        raise ValueError(
            f"Unknown byte2str_fallback strategy: {mode!r} "
            f"(expected one of {', '.join(_FALLBACKS)})"
        )
