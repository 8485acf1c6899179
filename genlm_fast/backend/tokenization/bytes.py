"""Recover the byte string behind every entry of a Hugging Face tokenizer."""

import json
import re


class ByteDecoderError(Exception):
    """A character-to-byte table does not reproduce the tokenizer's output."""


class ByteVocabError(Exception):
    """The tokenizer's byte encoding cannot be determined."""


class NotATokenizerError(TypeError, AttributeError):
    """The object given as a tokenizer lacks the Hugging Face tokenizer methods.

    An AttributeError too, which is what genlm raises in this case.
    """


# What every way of reading a vocabulary calls on the tokenizer.
_REQUIRED_METHODS = ("get_added_vocab", "convert_ids_to_tokens", "__len__")


def _require_tokenizer(tokenizer):
    """Raise NotATokenizerError unless ``tokenizer`` looks like a HF tokenizer."""
    missing = [m for m in _REQUIRED_METHODS if not callable(getattr(tokenizer, m, None))]
    if not missing:
        return
    hint = ""
    if type(tokenizer).__module__.split(".")[0] == "tokenizers":
        hint = (
            "; for a `tokenizers.Tokenizer`, wrap it first: "
            "transformers.PreTrainedTokenizerFast(tokenizer_object=tok)"
        )
    elif isinstance(tokenizer, (str, bytes)):
        hint = "; to load one by name: transformers.AutoTokenizer.from_pretrained(name)"
    raise NotATokenizerError(
        "expected a Hugging Face (transformers) tokenizer, got "
        f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}, which lacks "
        f"{', '.join(missing)}{hint}"
    )


def _name(tokenizer):
    """The tokenizer's ``name_or_path`` for messages (its type if it has none)."""
    return getattr(tokenizer, "name_or_path", type(tokenizer).__name__)


# Text whose round trip through the tokenizer validates a byte decoder: it is
# made of multi-byte characters a byte-level vocabulary must split correctly.
_PROBE = "’•¶∂ƒ˙∆£Ħ爨ൠᅘ∰፨"

_SP_SPACE = "▁".encode()
# Only a well-formed escape names a byte; text such as ``<0x%s>`` is left as it
# is (as the tokenizer's ByteFallback decoder leaves it) rather than crashing.
_SP_BYTE_ESCAPE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


def get_byte_vocab(tokenizer):
    """Return ``list[bytes]``, the bytes of token ``i`` at index ``i``.

    The encoding is chosen from the decoder declared by the tokenizer's
    backend: ``ByteFallback``/``Metaspace`` means SentencePiece pieces,
    ``ByteLevel`` means the GPT-2 byte alphabet, and anything else is refused.
    Without a backend, a ``sp_model`` attribute selects SentencePiece and
    otherwise the tokenizer's ``byte_decoder`` (or the GPT-2 one) is used if
    it survives a round-trip check.

    Raises:
        ByteVocabError: the encoding is unknown or fails its check.
    """
    kinds = _decoder_kinds(tokenizer)
    if kinds & {"ByteFallback", "Metaspace"}:
        return get_byte_tokens_from_sp(tokenizer)
    if "ByteLevel" in kinds:
        byte_decoder = _gpt2_byte_decoder()
        try:
            check_byte_decoder(tokenizer, byte_decoder)
        except ByteDecoderError as e:
            raise ByteVocabError(
                f"{_name(tokenizer)!r} has a ByteLevel decoder but its "
                "tokens do not round-trip through the GPT-2 byte alphabet"
            ) from e
        return get_byte_tokens_from_byte_decoder(tokenizer, byte_decoder)
    if kinds:
        raise ByteVocabError(
            f"{_name(tokenizer)!r} uses decoder {sorted(kinds)}, neither ByteLevel nor "
            "SentencePiece (ByteFallback/Metaspace): the only encodings supported"
        )

    if hasattr(tokenizer, "sp_model"):
        return get_byte_tokens_from_sp(tokenizer)
    byte_decoder = getattr(tokenizer, "byte_decoder", None) or _gpt2_byte_decoder()
    try:
        check_byte_decoder(tokenizer, byte_decoder)
    except ByteDecoderError as e:
        raise ByteVocabError(
            f"{_name(tokenizer)!r} has no decoder to inspect and its tokens "
            "do not round-trip through a byte-level alphabet"
        ) from e
    return get_byte_tokens_from_byte_decoder(tokenizer, byte_decoder)


def _decoder_kinds(tokenizer):
    """Every ``type`` name found in the backend decoder's JSON (nested too)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    kinds = set()
    stack = [_decoder_json(backend)]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                kinds.add(node["type"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return kinds


def _decoder_json(backend):
    """The backend's decoder as parsed JSON (None when it has no decoder)."""
    decoder = backend.decoder
    if decoder is None:
        return None
    try:  # serialising the decoder alone avoids dumping the whole vocabulary
        return json.loads(decoder.__getstate__())
    except Exception:
        return json.loads(backend.to_str()).get("decoder")


def _pieces(tokenizer):
    """``(id -> added-token text, token string of every id)``.

    Raises:
        ByteVocabError: some id below ``len(tokenizer)`` has no token (the ids
            have holes), so no list can hold token ``i`` at index ``i``.
    """
    _require_tokenizer(tokenizer)
    added = {i: text for text, i in tokenizer.get_added_vocab().items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    holes = [i for i, piece in enumerate(pieces) if piece is None and i not in added]
    if holes:
        shown = ", ".join(map(str, holes[:10])) + (", ..." if len(holes) > 10 else "")
        raise ByteVocabError(
            f"{_name(tokenizer)!r}: {len(holes)} token id(s) below len(tokenizer)="
            f"{len(pieces)} have no token ({shown}); the vocabulary's ids must be "
            "0 .. len(tokenizer) - 1 without gaps"
        )
    return added, pieces


def get_byte_tokens_from_byte_decoder(tokenizer, byte_decoder):
    """Map each character of each token through ``byte_decoder``.

    Added tokens are taken literally, as their UTF-8 text.
    """
    added, pieces = _pieces(tokenizer)
    return [
        added[i].encode() if i in added else bytes(byte_decoder[c] for c in piece)
        for i, piece in enumerate(pieces)
    ]


def get_byte_tokens_from_sp(tokenizer):
    """Turn SentencePiece pieces into bytes.

    ``<0xXX>`` escapes (two hex digits) become that byte, then every ``▁``
    becomes a space.
    Added tokens are not unescaped but do get the ``▁`` replacement.
    """
    added, pieces = _pieces(tokenizer)
    out = []
    for i, piece in enumerate(pieces):
        if i in added:
            raw = added[i].encode()
        else:
            raw = _SP_BYTE_ESCAPE.sub(lambda m: bytes.fromhex(m[1].decode()), piece.encode())
        out.append(raw.replace(_SP_SPACE, b" "))
    return out


def check_byte_decoder(tokenizer, byte_decoder):
    """Raise ByteDecoderError unless ``byte_decoder`` fits the tokenizer.

    It must cover every character of every non-added vocabulary entry, and
    the tokens of a probe text must map back to the probe's UTF-8 bytes.
    """
    _require_tokenizer(tokenizer)
    added = tokenizer.get_added_vocab()
    chars = {c for piece in tokenizer.get_vocab() if piece not in added for c in piece}
    missing = chars - byte_decoder.keys()
    if missing:
        raise ByteDecoderError(f"Byte decoder is missing characters: {missing}")

    try:
        ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        data = b"".join(
            bytes(byte_decoder[c] for c in tokenizer.convert_ids_to_tokens(i)) for i in ids
        )
        bos = getattr(tokenizer, "bos_token", None)
        if bos and data.startswith(bos.encode()):
            data = data[len(bos) :]
        text = data.decode()
    except Exception as e:
        raise ByteDecoderError(f"Could not map the tokens of {_PROBE!r} back to bytes") from e
    if text != _PROBE:
        raise ByteDecoderError(f"Round trip gave {text!r} instead of {_PROBE!r}")


def _gpt2_byte_decoder():
    """GPT-2's printable-character alphabet, inverted, plus raw whitespace."""
    # Bytes that are printable Latin-1 stand for themselves; the remaining
    # bytes are assigned code points 256, 257, ... in increasing order.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    decoder = {chr(b): b for b in printable}
    others = sorted(set(range(256)) - set(printable))
    decoder.update({chr(256 + k): b for k, b in enumerate(others)})
    decoder.update({" ": 0x20, "\n": 0x0A, "\r": 0x0D, "\t": 0x09, "▁": 0x20})
    return decoder
