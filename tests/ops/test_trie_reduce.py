"""The trie reductions on every backend: one test body, parametrized over backends.

Each backend runs through the public tries and the one dispatcher, and is compared with the
float64 brute-force oracle in tests/oracle.py (which never looks at the kernel layout).
Without a GPU the Triton backend runs under TRITON_INTERPRET=1 (set in conftest.py), so it
gets the small shapes; the compiled backends (and Triton on a GPU) also get the real
vocabularies.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.vocabs import byte_vocab
from genlm_fast.backend.tokenization import Token
from genlm_fast.backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
from genlm_fast.bytes import TokenByteTrie, TrieMode
from tests import oracle
from tests.ops.devices import device_for, require_cpu_extension

BACKENDS = [
    "reference",
    "cpu",
    "triton",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
REDUCTIONS = ["sum", "max", "log_mass"]


def char_trie(words, backend):
    """genlm.backend's character trie over ``words`` for ``backend``: the host-only
    ``TokenCharacterTrie`` (float64 results) where the backend runs on the CPU, the
    ``ParallelTokenCharacterTrie`` on the GPU (float32) for the GPU backends."""
    vocab = [Token(i, w) for i, w in enumerate(words)]
    if device_for(backend) == "cpu":
        return TokenCharacterTrie(vocab, cache=False)
    return ParallelTokenCharacterTrie(vocab, device="cuda", cache=False)


def make_rows(rng, B, C, reduction, spread=10.0, neg_inf=0.0):
    if reduction == "log_mass":
        rows = rng.standard_normal((B, C)) * spread
        if neg_inf:
            rows[rng.random((B, C)) < neg_inf] = -np.inf
            rows[:, 0] = 0.0  # keep every row normalisable
    elif reduction == "sum":
        rows = rng.random((B, C)) ** 8  # masses over many orders of magnitude
        rows[rng.random((B, C)) < 0.1] = 0.0
    else:
        rows = rng.standard_normal((B, C)) * 5  # negative log-weights included
        if neg_inf:
            rows[rng.random((B, C)) < neg_inf] = -np.inf
    return rows.astype(np.float32)


def check_trie(trie, rows, reduction, backend, mode=None, eos_positions=()):
    with_eos = mode == TrieMode.WITH_EOS
    pairs = oracle.members(trie, eos_positions, with_eos=with_eos)
    columns = [t.token_id for t in trie.decode] if isinstance(trie, TokenByteTrie) else None
    want = oracle.reduce(pairs, trie.num_nodes, rows, reduction, columns)
    # the trie's device is where its methods run the backend: it must be the backend's
    assert torch.device(trie.device).type == device_for(backend), (trie.device, backend)
    trie.kernel_backend = backend
    x = torch.from_numpy(rows).to(device_for(backend))
    if reduction == "log_mass":
        got = (
            trie.batch_log_mass(x, mode=mode)
            if isinstance(trie, TokenByteTrie)
            else trie.batch_log_mass(x)
        )
        assert got.dtype == torch.float32 and got.device == x.device
    elif isinstance(trie, TokenByteTrie):
        got = (
            trie.batch_weight_sum(x, mode=mode) if reduction == "sum" else trie.batch_weight_max(x)
        )
    else:
        got = trie.batch_weight_sum(x) if reduction == "sum" else trie.batch_weight_max(x)
    assert trie.last_kernel_backend == backend
    got = got.detach().cpu().numpy() if isinstance(got, torch.Tensor) else got
    oracle.assert_close(got, want, reduction, f"{backend}/{reduction}/{mode}")


# ------------------------------------------------------------------ random tries

words_strategy = st.lists(
    st.binary(min_size=0, max_size=9).map(lambda b: bytes(x % 4 + 97 for x in b)),
    min_size=1,
    max_size=160,
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(words=words_strategy, data=st.data())
def test_random_byte_tries(backend, reduction, words, data):
    """Random vocabularies over a 4-letter alphabet: duplicates, empty tokens, deep chains."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    vocab = [Token(i, w) for i, w in enumerate(words)]
    n_eos = data.draw(st.integers(0, min(3, len(words))))
    eos = sorted(set(words[:n_eos]))
    trie = TokenByteTrie(vocab, device=device_for(backend), eos_byte_strings=eos, cache=False)
    eos_positions = [i for i, w in enumerate(words) if w in set(eos)]
    B = data.draw(st.sampled_from([1, 2, 3]))
    extra = data.draw(st.sampled_from([0, 0, 7])) if reduction == "log_mass" else 0
    rows = make_rows(
        rng,
        B,
        len(words) + extra,
        reduction,
        spread=data.draw(st.sampled_from([1.0, 50.0, 400.0])),
        neg_inf=data.draw(st.sampled_from([0.0, 0.3])),
    )
    modes = [TrieMode.WITHOUT_EOS, TrieMode.WITH_EOS] if reduction != "max" else [None]
    for mode in modes:
        check_trie(trie, rows, reduction, backend, mode, eos_positions)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", ["one_token", "deep_chain", "wide_fanout", "duplicates"])
def test_shapes_that_hurt(backend, reduction, shape):
    rng = np.random.default_rng(7)
    if shape == "one_token":
        words = [b"x"]
    elif shape == "deep_chain":  # one path 300 bytes deep: crosses several tiles
        words = [b"z" * k for k in range(1, 301)]
    elif shape == "wide_fanout":  # every 1- and 2-byte string: fan-out 256 at the root
        words = [bytes([a]) for a in range(256)] + [
            bytes([a, b]) for a in range(0, 256, 5) for b in range(0, 256, 7)
        ]
    else:
        words = [b"ab", b"ab", b"a", b"ab", b"", b"", b"abc", b"b"] * 13
    trie = char_trie(words, backend)
    rows = make_rows(rng, 3, len(words), reduction, spread=30.0, neg_inf=0.2)
    check_trie(trie, rows, reduction, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["sum", "max"])
def test_float64_result_of_float32_values(backend, reduction):
    """float64_result (genlm's float64 tries on float32 weights, which skip the float64
    copy of the input) gives exactly the backend's result on the values converted to
    float64, as float64; for 1 to 19 rows (the CPU kernel's row blocks of 8, 4, 2, 1 and
    one row across threads), half-precision values too, and the oracle agrees."""
    from genlm_fast.ops import dispatch

    words = [bytes([97 + i % 3]) * (1 + i % 5) + bytes([i % 7 + 65]) for i in range(60)]
    trie = char_trie(words, backend)
    rng = np.random.default_rng(11)
    for B in (1, 3, 8, 19):
        rows = make_rows(rng, B, len(words), reduction, neg_inf=0.1)
        x = torch.from_numpy(rows).to(device_for(backend))
        got, used = dispatch.trie_reduce(
            x, trie._layout, reduction, backend=backend, float64_result=True
        )
        assert used == backend and got.dtype == torch.float64 and got.device == x.device
        want, _ = dispatch.trie_reduce(x.double(), trie._layout, reduction, backend=backend)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        half, _ = dispatch.trie_reduce(
            x.half(), trie._layout, reduction, backend=backend, float64_result=True
        )
        want_half, _ = dispatch.trie_reduce(
            x.half().double(), trie._layout, reduction, backend=backend
        )
        torch.testing.assert_close(half, want_half, rtol=0, atol=0)
        # and the float64 results against the float64 oracle (to double rounding)
        pairs = oracle.members(trie)
        for result, values in ((got, rows), (half, x.half().double().cpu().numpy())):
            want64 = oracle.reduce(pairs, trie.num_nodes, values, reduction)
            np.testing.assert_allclose(result.cpu().numpy(), want64, rtol=1e-12, atol=0)
    check_trie(trie, rows, reduction, backend)  # the public trie, against the oracle
    with pytest.raises(ValueError, match="float64_result is for sum and max"):
        dispatch.trie_reduce(x, trie._layout, "log_mass", backend=backend, float64_result=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inference_mode_then_grad_tracking_rows(backend, reduction):
    """A trie first used under torch.inference_mode() (its index tensors are made there)
    later takes rows that require grad: plain results, equal to the oracle's."""
    trie = TokenByteTrie(
        [Token(i, w) for i, w in enumerate([b"a", b"ab", b"b", b"abc"])], device=device_for(backend)
    )
    trie.kernel_backend = backend
    rows = make_rows(np.random.default_rng(3), 3, 4, reduction)
    x = torch.from_numpy(rows).to(device_for(backend))
    op = {
        "sum": trie.batch_weight_sum,
        "max": trie.batch_weight_max,
        "log_mass": trie.batch_log_mass,
    }[reduction]
    with torch.inference_mode():
        first = op(x)
    got = op(x.clone().requires_grad_(True))
    assert not got.requires_grad
    torch.testing.assert_close(got, first.clone(), rtol=0, atol=0)
    check_trie(trie, rows, reduction, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_mass_hundreds_of_nats(backend):
    """genlm-bytes 0.2.0 underflows to -inf here (it exponentiates first); we must not."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(90)]
    trie = TokenByteTrie(
        [Token(i, w) for i, w in enumerate(words)], device=device_for(backend), cache=False
    )
    rows = np.zeros((2, 90), dtype=np.float32)
    rows[0] = np.linspace(0, -900, 90)  # leaf log-probs down to -900
    rows[1] = -1000.0
    rows[1, 5] = 0.0
    rows[1, 40:50] = -np.inf  # nodes with only -inf logits beneath: exactly -inf
    check_trie(trie, rows, "log_mass", backend, TrieMode.WITHOUT_EOS)
    trie.kernel_backend = backend
    got = trie.batch_log_mass(torch.from_numpy(rows).to(device_for(backend))).cpu()
    has_leaves = torch.ones(trie.num_nodes, dtype=torch.bool)
    has_leaves[trie.eos_node] = False  # the EOS node holds nothing without EOS mode
    assert torch.isfinite(got[0][has_leaves]).all(), "a finite logit must give a finite log-mass"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_mass_logits_far_from_zero(backend, dtype):
    """Only differences of logits matter: rows around 1e12, 1e19, -1e30 and float32's
    largest values give the same log-masses as rows around 0. An lse formed as m + log(sum)
    in double rounds log(sum) away there (the CPU kernel made two tokens of 1e19 each
    probability 1)."""
    rng = np.random.default_rng(11)
    words = [bytes(rng.integers(97, 100, size=rng.integers(1, 5))) for _ in range(70)]
    trie = TokenByteTrie(
        [Token(i, w) for i, w in enumerate(words)], device=device_for(backend), cache=False
    )
    V = len(words)
    rows = np.zeros((5, V))
    rows[0, :] = -np.inf
    rows[0, [3, 17]] = 1e19  # two tokens, half the mass each
    rows[0, 20:40] = 0.0  # 1e19 nats below: the exact path's -1e19 - log 2
    rows[1, :] = -1e30  # all equal: uniform
    rows[2] = rng.uniform(-1.6e38, 1.6e38, V)  # log-probs down to -3.2e38: still floats
    rows[2, 5] = 1.7e38
    rows[3] = 1e12 + rng.standard_normal(V) * 4  # float64: a spread the row keeps
    rows[4] = rng.standard_normal(V) * 4  # the same spread around 0
    x = torch.from_numpy(rows).to(dtype)
    want = oracle.reduce(oracle.members(trie), trie.num_nodes, x.double().numpy(), "log_mass")
    trie.kernel_backend = backend
    got = trie.batch_log_mass(x.to(device_for(backend))).cpu().numpy()
    oracle.assert_close(got, want, "log_mass", f"{backend}/{dtype}")
    leaves = [trie.word2leaf[(w, i)] for i, w in enumerate(words)]
    np.testing.assert_allclose(got[0, [leaves[3], leaves[17]]], [-np.log(2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(got[1, leaves], -np.log(V), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_log_mass_low_precision_logits(backend, dtype):
    rng = np.random.default_rng(3)
    words = [bytes(rng.integers(97, 100, size=rng.integers(1, 6))) for _ in range(150)]
    trie = TokenByteTrie(
        [Token(i, w) for i, w in enumerate(words)], device=device_for(backend), cache=False
    )
    logits = torch.from_numpy(make_rows(rng, 2, 160, "log_mass", spread=8.0)).to(dtype)
    want = oracle.reduce(oracle.members(trie), trie.num_nodes, logits.float().numpy(), "log_mass")
    trie.kernel_backend = backend
    got = trie.batch_log_mass(logits.to(device_for(backend)))
    assert got.dtype == torch.float32
    oracle.assert_close(got.cpu().numpy(), want, "log_mass", f"{backend}/{dtype}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_batches_of_eight_rows_and_more(backend, reduction):
    """8, 19 and 40 rows, where the CUDA kernels stage the rows for their gather (a tile
    block's 8, 16 or 32 rows side by side per column, and a full block's columns dropped from
    L2 once read): full and partial blocks, each row at its own scale, rows wider than the
    vocabulary, -inf logits; log_mass also from float16 and bfloat16 logits."""
    rng = np.random.default_rng(8)
    words = [bytes(rng.integers(97, 101, size=rng.integers(1, 7))) for _ in range(130)]
    trie = TokenByteTrie(
        [Token(i, w) for i, w in enumerate(words)], device=device_for(backend), cache=False
    )
    extra = 9 if reduction == "log_mass" else 0
    for B in (8, 19, 40):
        rows = make_rows(rng, B, len(words) + extra, reduction, spread=40.0, neg_inf=0.1)
        rows *= np.logspace(-3, 1, B, dtype=np.float32)[:, None] if reduction != "sum" else 1
        check_trie(trie, rows, reduction, backend)
    if reduction == "log_mass":
        for dtype in (torch.float16, torch.bfloat16):
            logits = torch.from_numpy(rows).to(dtype)
            want = oracle.reduce(
                oracle.members(trie), trie.num_nodes, logits.float().numpy(), "log_mass"
            )
            got = trie.batch_log_mass(logits.to(device_for(backend)))
            assert trie.last_kernel_backend == backend
            oracle.assert_close(got.cpu().numpy(), want, "log_mass", f"{backend}/{dtype}")


# ------------------------------------------------------------------ bad rows

BAD_ROWS = [
    ("sum", "nan", "weight row 2 contains NaN"),
    ("max", "nan", "weight row 2 contains NaN"),
    ("log_mass", "nan", "logit row 2 contains NaN"),
    ("log_mass", "inf", r"logit row 2 contains \+inf"),
    ("log_mass", "-inf", r"logit row 2 has no finite logit \(all -inf\)"),
    ("sum", "inf-inf", r"weight row 2 holds both \+inf and -inf"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction,value,message", BAD_ROWS)
def test_bad_rows_are_named(backend, reduction, value, message):
    """The first bad row is named on every backend (the CPU kernel checks rows as it reads
    them, the CUDA kernels' row pass too, the dispatcher checks them for the others),
    wherever the bad value sits: under a leaf, or in a padding column past the vocabulary
    (log_mass takes wider rows), in a batch of 4 rows or of 9 (CUDA stages those); and
    +inf weights are no error for sum and max, but +inf and -inf in one sum are."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(40)]
    trie = TokenByteTrie(
        [Token(i, w) for i, w in enumerate(words)], device=device_for(backend), cache=False
    )
    trie.kernel_backend = backend
    rng = np.random.default_rng(5)
    width = 43 if reduction == "log_mass" else 40
    for B, column in itertools.product((4, 9), sorted({7, width - 1})):
        rows = make_rows(rng, B, width, reduction)
        if reduction != "log_mass":
            rows[1, 3] = np.inf
        if value == "-inf":
            rows[2] = -np.inf
        elif value == "inf-inf":  # two leaves of one node
            rows[2, [column, column - 3]] = [np.inf, -np.inf]
        else:
            rows[2, column] = float(value)
        if value != "inf-inf":  # (found in the sums: a NaN in any row is named first)
            rows[3, 0] = np.nan  # a later bad row: the first one is named
        x = torch.from_numpy(rows).to(device_for(backend))
        with pytest.raises(ValueError, match=message):
            if reduction == "log_mass":
                trie.batch_log_mass(x)
            elif reduction == "sum":
                trie.batch_weight_sum(x)
            else:
                trie.batch_weight_max(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_one_short_or_one_long_are_named(backend):
    """Logit rows may be wider than the vocabulary but not one entry narrower; weight rows
    must have exactly its length: a clear error on every backend (no read past the row,
    no silently ignored column), and the exact width works (against the oracle)."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(40)]
    trie = TokenByteTrie(
        [Token(i, w) for i, w in enumerate(words)], device=device_for(backend), cache=False
    )
    trie.kernel_backend = backend
    dev = device_for(backend)
    with pytest.raises(ValueError, match="needs at least 40"):
        trie.batch_log_mass(torch.zeros(2, 39, device=dev))
    with pytest.raises(ValueError, match="needs at least 40"):
        trie.log_mass(torch.zeros(39, device=dev))
    for op in (trie.batch_weight_sum, trie.batch_weight_max):
        for width in (39, 41):
            with pytest.raises(ValueError, match="length 40"):
                op(torch.ones(2, width, device=dev))
    rows = make_rows(np.random.default_rng(2), 2, 40, "sum")
    check_trie(trie, rows, "sum", backend, TrieMode.WITHOUT_EOS)


# ------------------------------------------------------------------ real vocabularies

REAL = [("gpt2", 4), ("smollm2", 4), ("llama3", 2)]


INTERPRETED = not torch.cuda.is_available()  # Triton runs under its CPU interpreter here


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,B", REAL)
def test_real_vocabularies(backend, name, B):
    vocab = byte_vocab(name)
    if backend == "triton" and INTERPRETED:
        # the interpreter runs ~100x slower than torch: the real byte strings of the first
        # 1,500 tokens (still several tiles and spanning nodes); the GPU gets all of them
        vocab, B = vocab[:1500], 1
    eos = [vocab[-1].byte_string]
    trie = TokenByteTrie(vocab, device=device_for(backend), eos_byte_strings=eos)
    eos_positions = [i for i, t in enumerate(vocab) if t.byte_string in set(eos)]
    rng = np.random.default_rng(11)
    V = len(vocab)
    for reduction in REDUCTIONS:
        rows = make_rows(
            rng,
            B,
            V + (17 if reduction == "log_mass" else 0),
            reduction,
            spread=60.0 if reduction == "log_mass" else 5.0,
            neg_inf=0.01,
        )
        check_trie(
            trie,
            rows,
            reduction,
            backend,
            TrieMode.WITH_EOS if reduction != "max" else None,
            eos_positions,
        )


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_row_schedules_on_smollm2(threads):
    """The CPU kernel's ways of sharing rows among its threads, each against the float64
    oracle: on a big trie (SmolLM2's, 149,591 nodes) 1 to 11 rows go in stacked blocks of 8, 4
    or 2, in rounds of one block per thread, the rows left over one by one with every thread on
    each (the one-row sweep); a bad row is named first wherever it falls, in a block or among
    the rows left over, even with a later bad row in the other part."""
    from genlm_fast.ops import cpu_backend, extension

    require_cpu_extension()
    module = extension.load_module()
    trie = TokenCharacterTrie(byte_vocab("smollm2"), cache=False)
    arrays = trie.layout.device_arrays("without_eos", torch.device("cpu"), "cpu")
    pairs = oracle.members(trie)
    rng = np.random.default_rng(21)
    for reduction in REDUCTIONS:
        rows = make_rows(rng, 11, len(trie.decode), reduction, spread=30.0, neg_inf=0.01)
        want = oracle.reduce(pairs, trie.num_nodes, rows, reduction)
        for B in range(1, 12):
            x = torch.from_numpy(rows[:B]).contiguous()
            got = cpu_backend.run_kernel(module, x, arrays, reduction, num_threads=threads)
            oracle.assert_close(got.numpy(), want[:B], reduction, f"{reduction}/B={B}/T={threads}")
    rows = make_rows(rng, 9, len(trie.decode), "sum")
    for bad in [(8,), (1, 8), (3, 5)]:
        x = torch.from_numpy(rows).clone()
        for r in bad:
            x[r, 100 * r] = float("nan")
        with pytest.raises(ValueError, match=f"weight row {bad[0]} contains NaN"):
            cpu_backend.run_kernel(module, x, arrays, "sum", num_threads=threads)


def test_cpu_results_on_smollm2_do_not_depend_on_the_team():
    """The CPU kernel splits its work for the usable CPUs, whatever team runs it (the team
    follows torch's setting and other processes' load): 1 to 11 rows on SmolLM2's trie give
    the same bits from a team of one thread (torch set to one) as from a team as large as the
    usable CPUs (named), float64 results included (where another order of the additions
    would show)."""
    from genlm_fast.ops import cpu_backend, extension

    require_cpu_extension()
    module = extension.load_module()
    usable = module.cpu_threads_info()["usable_cpus"]
    if usable < 2:
        pytest.skip("one usable CPU: every team is one thread")
    trie = TokenCharacterTrie(byte_vocab("smollm2"), cache=False)
    arrays = trie.layout.device_arrays("without_eos", torch.device("cpu"), "cpu")
    rng = np.random.default_rng(22)
    threads = torch.get_num_threads()
    try:
        for reduction, wide in [("sum", True), ("max", True), ("log_mass", False)]:
            rows = torch.from_numpy(make_rows(rng, 11, len(trie.decode), reduction, spread=30.0))
            for B in range(1, 12):
                x = rows[:B].contiguous()
                torch.set_num_threads(threads)
                full = cpu_backend.run_kernel(
                    module, x, arrays, reduction, num_threads=usable, float64_result=wide
                )
                torch.set_num_threads(1)
                alone = cpu_backend.run_kernel(module, x, arrays, reduction, float64_result=wide)
                assert torch.equal(full, alone), (reduction, B)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_character_trie_results_are_pinned_host_arrays():
    """ParallelTokenCharacterTrie(device="cuda") hands its results to the host through
    pinned blocks (genlm_fast/backend/trie/base.py, to_host; the pool's bookkeeping is
    tested on the CPU in tests/backend/test_trie_values.py): each a numpy array over page-locked
    memory, its own (two calls do not share a block while both arrays live), the oracle's
    values."""
    words = [bytes([97 + i % 3]) * (1 + i // 3) for i in range(40)]
    trie = ParallelTokenCharacterTrie(
        [Token(i, w) for i, w in enumerate(words)], device="cuda", cache=False
    )
    rows = make_rows(np.random.default_rng(4), 3, len(words), "sum")
    first = trie.batch_weight_sum(torch.from_numpy(rows).cuda())
    second = trie.batch_weight_sum(torch.from_numpy(rows[::-1].copy()).cuda())
    for array in (first, second):
        assert isinstance(array, np.ndarray) and array.dtype == np.float32
        assert isinstance(array.base, torch.Tensor) and array.base.is_pinned()
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, second[::-1])
    check_trie(trie, rows, "sum", "cuda", TrieMode.WITHOUT_EOS)
