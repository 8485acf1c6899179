"""The byte-level beam the benchmarks run, built and stepped alike on either library.

    make = beam_maker("genlm", lm, K=5)   # genlm-bytes' trie is built here, once
    beam = await make()                   # a fresh beam after BOS
    logp, beam = await advance(beam, b"The sky is", b" blue")

``library`` is ``"genlm_fast"`` (genlm_fast.bytes' ``ByteBeamState`` on genlm_fast's
``AsyncTransformer``) or ``"genlm"`` (genlm-bytes 0.2.0's ``ByteBeamState`` on
genlm-backend's). Both beams use ``BeamParams(K=K)`` and nothing else, so the two libraries
run the same search.
"""

from __future__ import annotations

LIBRARIES = ("genlm_fast", "genlm")


def beam_maker(library, lm, K, device="cpu"):
    """An async function that returns a new beam (K beams, after BOS) on ``lm``.

    genlm_fast keeps one trie per model, so its beams come from ``ByteBeamState.initial``.
    genlm-bytes' ``ByteBeamState.initial`` would build a trie on every call; here its trie
    (``AsyncTokenByteTrie``, on ``device``) is built once, outside whatever is timed, and
    each beam starts from a fresh ``LazyTrieState`` on it, as ``initial`` itself does.
    """
    if library == "genlm_fast":
        from genlm_fast.bytes import BeamParams, ByteBeamState

        fast_params = BeamParams(K=K)

        async def make_fast():
            return await ByteBeamState.initial(lm, fast_params)

        return make_fast
    if library != "genlm":
        raise ValueError(f"unknown library {library!r} (known: {', '.join(LIBRARIES)})")
    import warnings

    import genlm.bytes as ref_bytes
    from genlm.bytes.trie import TrieMode

    params = ref_bytes.BeamParams(K=K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trie = ref_bytes.AsyncTokenByteTrie.from_vocab(
            lm.byte_vocab, eos_byte_strings=params.eos_byte_strings, device=device
        )

    async def make_genlm():
        state = ref_bytes.LazyTrieState.initial(lm, trie, mode=TrieMode.WITH_EOS)
        return ref_bytes.ByteBeamState([await state.materialize()], params)

    return make_genlm


async def make_beam(library, lm, K, device="cpu"):
    """One new beam after BOS (`beam_maker`'s, for a caller that needs only one)."""
    return await beam_maker(library, lm, K, device)()


async def advance(beam, prefill, steps):
    """The beam's workload: ``prefill`` the bytes, then for each byte of ``steps`` read
    ``logp_next``, prune and extend by the byte; returns the last ``logp_next`` and the
    final beam."""
    beam = await beam.prefill(prefill)
    for b in steps:
        await beam.logp_next()
        beam = await (beam.prune() << b)
    return await beam.logp_next(), beam
