"""Recover the byte string behind every entry of a Hugging Face tokenizer."""

import json
import re


class ByteDecoderError(Exception):
    """A character-to-byte table does not reproduce the tokenizer's output."""


class ByteVocabError(Exception):
    """The tokenizer's byte encoding cannot be determined."""


# Text whose round trip through the tokenizer validates a byte decoder: it is
# made of multi-byte characters a byte-level vocabulary must split correctly.
_PROBE = "’•¶∂ƒ˙∆£Ħ爨ൠᅘ∰፨"

_SP_SPACE = "▁".encode()
_SP_BYTE_ESCAPE = re.compile(rb"<0x(..)>")


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
                f"{tokenizer.name_or_path!r} has a ByteLevel decoder but its "
                "tokens do not round-trip through the GPT-2 byte alphabet"
            ) from e
        return get_byte_tokens_from_byte_decoder(tokenizer, byte_decoder)
    if kinds:
        raise ByteVocabError(
            f"{tokenizer.name_or_path!r} uses decoder {sorted(kinds)}, neither ByteLevel nor "
            "SentencePiece (ByteFallback/Metaspace): the only encodings supported"
        )

    if hasattr(tokenizer, "sp_model"):
        return get_byte_tokens_from_sp(tokenizer)
    byte_decoder = getattr(tokenizer, "byte_decoder", None) or _gpt2_byte_decoder()
    try:
        check_byte_decoder(tokenizer, byte_decoder)
    except ByteDecoderError as e:
        raise ByteVocabError(
            f"{tokenizer.name_or_path!r} has no decoder to inspect and its tokens "
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
    """``(id -> added-token text, token string of every id)``."""
    added = {i: text for text, i in tokenizer.get_added_vocab().items()}
    return added, tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))


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

    ``<0xXX>`` escapes become that byte, then every ``▁`` becomes a space.
    Added tokens are not unescaped but do get the ``▁`` replacement.
    """
    added, pieces = _pieces(tokenizer)
    out = []
    for i, piece in enumerate(pieces):
        if i in added:
            raw = added[i].encode()
        else:
            raw = _SP_BYTE_ESCAPE.sub(
                lambda m: bytes.fromhex(m[1].decode()), piece.encode()
            )
        out.append(raw.replace(_SP_SPACE, b" "))
    return out


def check_byte_decoder(tokenizer, byte_decoder):
    """Raise ByteDecoderError unless ``byte_decoder`` fits the tokenizer.

    It must cover every character of every non-added vocabulary entry, and
    the tokens of a probe text must map back to the probe's UTF-8 bytes.
    """
    added = tokenizer.get_added_vocab()
    chars = {c for piece in tokenizer.get_vocab() if piece not in added for c in piece}
    missing = chars - byte_decoder.keys()
    if missing:
        raise ByteDecoderError(f"Byte decoder is missing characters: {missing}")

    try:
        ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        data = b"".join(
            bytes(byte_decoder[c] for c in tokenizer.convert_ids_to_tokens(i))
            for i in ids
        )
        bos = getattr(tokenizer, "bos_token", None)
        if bos and data.startswith(bos.encode()):
            data = data[len(bos) :]
        text = data.decode()
    except Exception as e:
        raise ByteDecoderError(
            f"Could not map the tokens of {_PROBE!r} back to bytes"
        ) from e
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
