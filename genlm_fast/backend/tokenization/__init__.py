"""Vocabulary layer compatible with ``genlm.backend.tokenization``."""

from .bytes import ByteDecoderError, ByteVocabError, NotATokenizerError, get_byte_vocab
from .token import Token
from .vocab import bytes_to_strs, decode_vocab

__all__ = [
    "Token",
    "decode_vocab",
    "bytes_to_strs",
    "get_byte_vocab",
    "ByteVocabError",
    "ByteDecoderError",
    "NotATokenizerError",
]
