"""The byte-level beam (genlm_fast.bytes) on bad input: each a clear exception, as
genlm-bytes 0.2.0 raises where callers catch it; also the next-byte distribution
(``LazyByteProbs``, ``Chart``) against genlm-bytes' and importing without the display packages.
"""

from __future__ import annotations

import subprocess
import sys

import genlm.bytes as ref_bytes
import numpy as np
import pytest
import torch

from genlm_fast.bytes import (
    EOS,
    BeamParams,
    ByteBeamState,
    Chart,
    EmptyBeamError,
    LazyByteProbs,
    LazyTrieState,
    TokenHealer,
)
from tests.bytes.beam_support import GPT2_EOS


@pytest.mark.asyncio
async def test_bad_bytes(mock):
    beam = await ByteBeamState.initial(mock, BeamParams(K=2))
    for bad in (256, 258, -1, 1000):
        with pytest.raises(ValueError, match="out of range"):
            await (beam << bad)
    for bad in ("a", b"a", 1.5, None, True):
        with pytest.raises(TypeError, match="byte"):
            await (beam << bad)
    for bad in (256, 300):
        with pytest.raises(ValueError, match="out of range"):
            beam.states[0] << bad
    with pytest.raises(ValueError, match="Invalid index"):
        (await beam.logp_next())[258]
    await (beam << np.int64(72))  # numpy ints are fine


@pytest.mark.asyncio
async def test_empty_beam(mock):
    beam = await ByteBeamState.initial(mock, BeamParams(K=2, eos_byte_strings=[GPT2_EOS]))
    done = await (beam << EOS)  # reading EOS ends every hypothesis
    assert len(done) == 1 and done.states[0].terminated
    # nothing can follow EOS: every next byte has log-probability -inf (genlm-bytes: NaN)
    assert np.isneginf(np.asarray((await done.logp_next()).ps)).all()
    empty = await (done.prune() << ord("a"))  # nothing follows EOS: probability zero
    assert len(empty) == 0 and empty.logZ == -np.inf
    # reading on stays empty, as in genlm-bytes (text of probability zero scores -inf);
    # reading the next-byte distribution of an empty beam raises
    for later in (await (empty << ord("b")), await empty.prefill(b"bc")):
        assert len(later) == 0 and later.logZ == -np.inf
    with pytest.raises(EmptyBeamError, match="empty beam"):
        await empty.logp_next()
    with pytest.raises(EmptyBeamError):
        await ByteBeamState([], BeamParams(K=1)).logp_next()
    with pytest.raises(AssertionError):  # what genlm-bytes raises there: callers catch it
        await empty.logp_next()
    with pytest.raises(AssertionError, match="Beam is empty"):
        await ref_bytes.ByteBeamState([], ref_bytes.BeamParams(K=1)).logp_next()
    assert len(empty.prune()) == 0 and await empty.extend(0.0) == []


def test_bad_params():
    for K in (0, -3):
        with pytest.raises(ValueError, match="at least 1"):
            BeamParams(K=K)
    for K in (1.5, "5", True, None):
        with pytest.raises(TypeError, match="K must be an int"):
            BeamParams(K=K)
    with pytest.raises(ValueError, match="non-negative"):
        BeamParams(K=2, prune_threshold=-0.1)
    with pytest.raises(ValueError):
        BeamParams(K=2, prune_threshold=float("nan"))
    for bad in ("0.1", b"0.1", None):  # genlm-bytes raises TypeError for these too
        with pytest.raises(TypeError, match="prune_threshold must be a number"):
            BeamParams(K=2, prune_threshold=bad)
    assert BeamParams(K=2, prune_threshold=np.float32(0.25)).prune_threshold == 0.25
    with pytest.raises(TypeError, match="collection of byte strings"):
        BeamParams(K=2, eos_byte_strings=b"<|endoftext|>")
    with pytest.raises(TypeError, match="bytes"):
        BeamParams(K=2, eos_byte_strings=["<|endoftext|>"])
    with pytest.raises(TypeError, match="both"):
        BeamParams(K=2, eos_byte_strings=[b"a"], eos_tokens=[b"a"])
    with pytest.raises(ValueError, match="heal_max_backoff"):
        BeamParams(K=2, heal_max_backoff=-1)
    for name in ("max_backoff", "max_splits"):  # the healer itself, used directly
        for bad in (-1, True, 1.5, "2"):
            with pytest.raises(ValueError, match=name):
                TokenHealer(**{name: bad})
        assert getattr(TokenHealer(**{name: 0}), name) == 0
    with pytest.warns(DeprecationWarning, match="eos_tokens"):
        p = BeamParams(K=2, eos_tokens=[b"x"])
    assert p.eos_byte_strings == {b"x"} and p.eos_tokens is None
    assert BeamParams(K=2, eos_byte_strings=[bytearray(b"x"), b"x"]).eos_byte_strings == {b"x"}
    assert BeamParams(K=3).log_prune_threshold == -np.inf


@pytest.mark.asyncio
async def test_bad_prefill(mock):
    beam = await ByteBeamState.initial(mock, BeamParams(K=2))
    with pytest.raises(TypeError, match="encode it first"):
        await beam.prefill("Hello")
    for bad in (None, 42, 3.0, [b"a"]):
        with pytest.raises(TypeError, match="prefill expects bytes"):
            await beam.prefill(bad)
    with pytest.raises(ValueError, match="0..255"):
        await beam.prefill([72, 300])
    with pytest.raises(ValueError, match="0..255"):
        await beam.prefill([257])
    ok = await beam.prefill(bytearray(b"Hi"))
    # any iterable of ints 0..255, as genlm-bytes reads it
    for same in (
        [72, 105],
        np.array([72, 105]),
        np.frombuffer(b"Hi", dtype=np.uint8),
        (b for b in b"Hi"),
        torch.tensor([72, 105]),
    ):
        assert (await beam.prefill(same)).logZ == pytest.approx(ok.logZ)
    with pytest.raises(TypeError, match="prefill expects bytes"):
        await beam.prefill(np.array([72.0, 105.0]))
    with pytest.raises(TypeError, match="BeamParams"):
        await ByteBeamState.initial(mock, {"K": 2})
    with pytest.raises(ValueError, match="not in vocabulary"):
        await ByteBeamState.initial(mock, BeamParams(K=2, eos_byte_strings=[b"\xff\xfe!!nope"]))
    with pytest.raises(ValueError, match="not yet materialized"):
        _ = LazyTrieState.initial(mock, beam.states[0].trie).mass


def test_lazy_byte_probs_and_chart():
    ps = np.full(258, -np.inf)
    ps[65], ps[256], ps[257] = np.log(0.5), np.log(0.25), np.log(0.25)
    q = LazyByteProbs(ps)
    assert q[65] == ps[65] and q[None] == ps[256] and q[257] == ps[257]
    with pytest.raises(ValueError):
        LazyByteProbs(ps[:10])
    from genlm.bytes.util import LazyByteProbs as RefLazyByteProbs

    ref_q = RefLazyByteProbs(ps)
    for b in (-1, -2, -3, -258):  # counted from the end, as genlm-bytes does: -1 is EOS
        assert q[b] == ref_q[b] == ps[b]
    with pytest.raises(ValueError, match="Invalid index"):
        q[-259]
    chart = q.materialize()
    assert isinstance(chart, Chart) and chart.argmax() == 65 and chart[1000] == -np.inf
    assert q.pretty()[b"A"] == ps[65] and q.pretty()["EOS"] == ps[257]
    probs = chart.map_values(np.exp).trim()
    assert probs.sum() == pytest.approx(1.0) and probs.top(1) == {65: 0.5}
    assert (probs + probs)[65] == 1.0 and probs.normalize()[None] == pytest.approx(0.25)


def test_imports_without_display_packages():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('IPython', 'pandas', 'arsenal'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import genlm_fast.bytes as b\n"
        "from genlm_fast.bytes import ByteBeamState, BeamParams, LazyTrieState, TokenHealer\n"
        "from genlm_fast.bytes import StatefulTokenizedLM, StatefulByteLM, Chart, EOS\n"
        "from genlm_fast.bytes.util import format_table\n"
        "print(format_table([[1, 2]], headings=['a', 'b']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "<table>" in out.stdout
