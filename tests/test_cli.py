"""``genlm-fast demo`` (genlm_fast.demo) and the command line, on the real SmolLM2-135M-Instruct.

The demo's numbers are checked against computations that do not go through genlm_fast:

* the next-byte distribution after the prompt, and the greedy and seeded sampled
  continuations, against genlm-bytes 0.2.0's beam on genlm-backend 0.3.1's AsyncTransformer
  (same model directory, same K and EOS; the sampled one drawn by genlm-bytes' own sampler,
  arsenal's inverse-CDF ``sample_dict``, from the same uniform draws);
* with an empty prompt, the first-byte distribution against a brute-force sum over the
  vocabulary of a float64 forward pass: P(first byte = b) = sum of p(token) over the tokens
  whose bytes start with b (the end-of-sequence token counting as EOS instead);
* the prefix log-probability: the sum of its per-byte terms, each equal to the reference
  beam's next-byte log-probability along the string;
* importance sampling: weights normalized, every particle within the mask (token count and
  token lengths), its text the bytes of its tokens, its log-weight recomputed from
  genlm-backend's next-token log-probabilities with the same mask.

Then the command line: ``main(["demo", ...])`` prints every section and returns 0; a model
path that does not exist gives a one-line error and exit status 2.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from genlm_fast.__main__ import main
from genlm_fast.bytes.util import EOS_INDEX
from genlm_fast.demo import demo

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
STRING = " Paris"
SMALL = {
    "n_bytes": 4,
    "n_particles": 4,
    "max_tokens": 3,
    "max_token_length": 4,
    "K": 5,
    "seed": 3,
    "top": 10,
}
TOL, FLOOR = 2e-3, 1e-4  # next-byte log-probabilities, on outcomes with p > FLOOR


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """One torch thread: small latency-bound ops, and OpenMP hand-offs are very slow on a
    shared 2-core machine (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def cli_environment(monkeypatch):
    """``main(["demo"])`` sets these when unset; set here, they are restored after each test."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def model_dir():
    from genlm_fast.models import smollm2_path

    return smollm2_path(quiet=True)


@pytest.fixture(scope="module")
def ours(model_dir):
    from genlm_fast.backend.llm import AsyncTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = AsyncTransformer.from_name(model_dir)
    yield lm
    lm.cleanup()


@pytest.fixture(scope="module")
def ref_lm(model_dir):
    import genlm.backend.llm as ref_llm  # the reference, a pinned test dependency

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ref_llm.AsyncTransformer.from_name(model_dir)  # offline: a local directory


@pytest.fixture(scope="module")
def result(ours):
    return demo(llm=ours, prompt=PROMPT, string=STRING, verbose=False, **SMALL)


@pytest.fixture(scope="module")
def reference(ref_lm, result):
    """genlm-bytes on genlm-backend: the same four byte-level computations as the demo."""
    import genlm.bytes as ref_bytes
    from arsenal.maths import sample_dict  # genlm-bytes' own sampler (its default draw)

    eos = [bytes(ref_lm.byte_vocab[ref_lm.tokenizer.eos_token_id])]
    prompt, string = PROMPT.encode(), STRING.encode()

    async def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = await ref_bytes.ByteBeamState.initial(
                ref_lm, ref_bytes.BeamParams(K=SMALL["K"], eos_byte_strings=eos)
            )
        beam = await start.prefill(prompt)
        first = np.asarray((await beam.logp_next()).ps, dtype=np.float64)
        per_byte = []
        for b in string:
            per_byte.append(np.asarray((await beam.logp_next()).ps, dtype=np.float64)[b])
            beam = await (beam.prune() << b)
        greedy = await start.greedy(prompt, SMALL["n_bytes"])
        rng = np.random.default_rng(SMALL["seed"])
        sampled = await start.sample(
            prompt, SMALL["n_bytes"], draw=lambda q: sample_dict(q, u=rng.uniform())
        )
        return {"first": first, "per_byte": per_byte, "greedy": greedy, "sampled": sampled}

    return asyncio.run(run())


def close_logps(ours, ref):
    big = (np.exp(ours) > FLOOR) | (np.exp(ref) > FLOOR)
    return float(np.max(np.abs(ours[big] - ref[big])))


# ---------------------------------------------------------------------------- 1. next byte


def test_next_byte_distribution_is_normalized_and_sorted(result):
    logps = result.next_byte_logps
    assert logps.shape == (258,)
    assert abs(np.exp(logps).sum() - 1.0) < 1e-6
    probs = [p for _, p in result.top_bytes]
    assert len(probs) == SMALL["top"] and probs == sorted(probs, reverse=True)
    for symbol, p in result.top_bytes:
        assert p == pytest.approx(math.exp(logps[symbol]))
    assert result.top_bytes[0][0] == ord(" ")  # "The capital of France is" -> " Paris"


def test_next_byte_distribution_matches_genlm_bytes(result, reference):
    assert close_logps(result.next_byte_logps, reference["first"]) <= TOL


def test_first_byte_matches_brute_force_over_the_vocabulary(ours, model_dir):
    """Empty prompt: the beam's first-byte distribution is a sum over the vocabulary."""
    from transformers import AutoModelForCausalLM

    res = demo(
        llm=ours,
        prompt="",
        string="T",
        n_bytes=0,
        n_particles=1,
        max_tokens=1,
        max_token_length=4,
        K=2,
        seed=0,
        verbose=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    bos, eos = ours.tokenizer.bos_token_id, ours.tokenizer.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([[bos]])).logits[0, -1]
    probs = torch.softmax(logits, dim=-1).numpy()
    eos_bytes = bytes(ours.byte_vocab[eos])
    expected = np.zeros(258)
    for token_id, token in enumerate(ours.byte_vocab):
        if bytes(token) == eos_bytes:
            expected[EOS_INDEX] += probs[token_id]
        elif len(token):
            expected[token[0]] += probs[token_id]
    got = np.exp(res.next_byte_logps)
    assert abs(expected.sum() - 1.0) < 1e-9  # every token has a first byte (or is EOS)
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-6)
    # and the prefix probability of one byte is that byte's probability
    assert res.prefix_logp == pytest.approx(math.log(expected[ord("T")]), abs=2e-3)


# ---------------------------------------------------------------------------- 2. continuations


def test_continuations_match_genlm_bytes(result, reference):
    prompt = PROMPT.encode()
    for text in (result.greedy, result.sampled):
        assert text.startswith(prompt) and len(text) == len(prompt) + SMALL["n_bytes"]
    assert result.greedy == reference["greedy"]
    assert result.sampled == reference["sampled"]  # same seed, same inverse-CDF draws


def test_sampling_is_seeded(ours, result):
    again = demo(
        llm=ours,
        prompt=PROMPT,
        string="",
        verbose=False,
        **{**SMALL, "n_particles": 1, "max_tokens": 1},
    )
    assert again.sampled == result.sampled and again.greedy == result.greedy


# ---------------------------------------------------------------------------- 3. prefix


def test_prefix_probability(result, reference):
    per_byte = result.string_byte_logps
    assert len(per_byte) == len(STRING.encode())
    assert result.prefix_logp == pytest.approx(sum(per_byte), abs=1e-12)
    assert per_byte[0] == pytest.approx(result.next_byte_logps[ord(" ")], abs=1e-12)
    np.testing.assert_allclose(per_byte, reference["per_byte"], atol=TOL)
    assert -3.0 < result.prefix_logp < 0.0  # " Paris" is likely after the prompt


# ---------------------------------------------------------------------------- 4. SIS


def test_importance_sampling_particles_respect_the_mask(ours, result):
    assert len(result.particles) == SMALL["n_particles"]
    assert sum(p.weight for p in result.particles) == pytest.approx(1.0, abs=1e-9)
    ess = 1.0 / sum(p.weight**2 for p in result.particles)
    assert result.effective_sample_size == pytest.approx(ess)
    assert 1.0 - 1e-9 <= ess <= SMALL["n_particles"] + 1e-9
    eos = ours.tokenizer.eos_token_id
    for p in result.particles:
        assert 0.0 <= p.weight <= 1.0 and math.isfinite(p.log_weight)
        assert len(p.token_ids) <= SMALL["max_tokens"]
        assert eos not in p.token_ids
        assert all(len(ours.byte_vocab[t]) <= SMALL["max_token_length"] for t in p.token_ids)
        text = b"".join(bytes(ours.byte_vocab[t]) for t in p.token_ids)
        assert p.text == text.decode("utf-8", "replace")
    ids = result.sis_prompt_ids
    assert ids[0] == ours.tokenizer.bos_token_id
    assert ids[1:] == ours.tokenizer.encode(PROMPT, add_special_tokens=False)


def test_importance_weights_match_genlm_backend(ref_lm, result):
    """log-weight = sum over steps of log sum_{allowed t} p(t | context), recomputed."""
    eos, L = ref_lm.tokenizer.eos_token_id, SMALL["max_token_length"]
    allowed = torch.tensor([len(t) <= L for t in ref_lm.byte_vocab])
    allowed[eos] = True
    contexts, owners = [], []
    for i, p in enumerate(result.particles):
        for n in range(len(p.token_ids) + 1):  # every step, the last one drawing EOS
            contexts.append(result.sis_prompt_ids + p.token_ids[:n])
            owners.append((i, n))
    rows = ref_lm.batch_next_token_logprobs_sync(contexts).double().cpu()
    rows = rows[:, : len(ref_lm.byte_vocab)]
    expected = np.zeros(len(result.particles))
    for (i, n), row in zip(owners, rows):
        if n >= SMALL["max_tokens"]:
            expected[i] += float(row[eos])
        else:
            expected[i] += float(torch.logsumexp(row[allowed], dim=0))
    got = np.array([p.log_weight for p in result.particles])
    np.testing.assert_allclose(got, expected, atol=1e-3)


def test_timings_are_reported(result):
    for section in (
        "load model",
        "build byte trie",
        "next-byte distribution",
        "greedy continuation",
        "sampled continuation",
        "prefix probability",
        "importance sampling",
    ):
        assert result.timings[section] >= 0.0
    assert result.timings["importance sampling"] > 0.0


# ---------------------------------------------------------------------------- command line


def test_cli_demo_prints_every_section(model_dir, capsys):
    rc = main(
        [
            "demo",
            "--bytes",
            "2",
            "--particles",
            "2",
            "--tokens",
            "2",
            "--beam",
            "2",
            "--string",
            " P",
            "--top",
            "3",
            "--seed",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for header in (
        "== 1. Next-byte distribution",
        "== 2. Byte-level continuations",
        "== 3. Prefix probability of ' P'",
        "== 4. Auto-batched sequential importance",
        "== Timings ==",
        "total",
    ):
        assert header in out, header


def test_cli_missing_model_is_a_clear_error(tmp_path, capsys):
    rc = main(["demo", "--model", str(tmp_path / "no-such-model")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "does not exist" in err and "no-such-model" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_not_a_model_directory(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_cuda_without_a_gpu(capsys):
    assert main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "device,message",
    [
        ("meta", "runs on cpu or cuda"),
        ("mps", "runs on cpu or cuda"),
        ("foo", "unknown device 'foo'"),
    ],
)
def test_cli_devices_that_cannot_run_the_model(device, message, capsys):
    """Checked before any model is loaded: meta loaded the model, then failed deep in the
    beam with a 105-line traceback ('Tensor.item() cannot be called on meta tensors')."""
    assert main(["demo", "--device", device]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_info_into_a_closed_pipe():
    """`genlm-fast info | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    proc = subprocess.run(
        f"{sys.executable} -m genlm_fast info | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.startswith("genlm_fast ")
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("args", [["--beam", "0"], ["--particles", "-1"], ["--bytes", "x"]])
def test_cli_bad_numbers(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_model_preparation_is_quiet_when_asked(model_dir, capsys):
    from genlm_fast.models import smollm2_path
    from genlm_fast.models.store import show_progress

    assert smollm2_path(quiet=True) == model_dir  # prepared already: instant, silent
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert show_progress(True) is False and show_progress(False) is True
    assert show_progress(None) is False  # pytest's captured stderr is not a terminal


def test_cli_printed_weights_are_normalized(model_dir, capsys):
    """The importance weights the demo prints (4 decimals each) add up to 1."""
    rc = main(
        [
            "demo",
            "--bytes",
            "0",
            "--particles",
            "3",
            "--tokens",
            "2",
            "--beam",
            "1",
            "--string",
            "",
            "--top",
            "1",
            "--seed",
            "2",
            "--threads",
            "1",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    start = out.index("   weight  continuation") + 1
    weights = [float(line.split()[0]) for line in out[start : start + 3]]
    assert "effective sample size" in out[start + 3]
    assert sum(weights) == pytest.approx(1.0, abs=3 * 5e-5)
    assert weights == sorted(weights, reverse=True)


# ---------------------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", "-1"], "--seed: must be between 0 and 2**64 - 1, got -1"),
        (["--seed", str(2**64)], "--seed: must be between 0 and 2**64 - 1"),
        (["--threads", str(10**12)], "--threads: must be at most"),
        (["--bytes", "x"], "--bytes: not an integer: 'x'"),
        (["--beam", "1.5"], "--beam: not an integer: '1.5'"),
    ],
)
def test_cli_bad_options_rejected_before_anything_runs(args, message, capsys):
    """Out-of-range seeds (which numpy and torch reject half-way through the demo: 'expected
    non-negative integer', 'Overflow when unpacking long long'), --threads 100000 (which
    would crash the process) and bad integers are named before anything runs, by option."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
    assert "_count" not in captured.err and "_positive" not in captured.err


@pytest.mark.parametrize(
    "option",
    [
        {"n_particles": 0},
        {"K": 0},
        {"seed": -1},
        {"top": 0},
        {"n_bytes": -1},
        {"max_tokens": 0},
        {"threads": 0},
        {"seed": 2**64},
        {"K": 2.5},
        {"prompt": b"bytes"},
    ],
)
def test_demo_api_checks_options_before_loading(option, tmp_path):
    """`demo(...)` rejects bad options first (n_particles=0 would run every section and
    then fail on an empty array); the missing model shows nothing was loaded."""
    wrong_type = option in ({"K": 2.5}, {"prompt": b"bytes"})
    with pytest.raises(TypeError if wrong_type else ValueError):
        demo(model=str(tmp_path / "missing"), verbose=False, **option)


def test_cli_cuda_is_checked_before_converting(tmp_path, monkeypatch, capsys):
    """--device cuda on a machine without CUDA fails at once, not after a conversion."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    from genlm_fast.models import smollm2

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted a model before checking the device")

    monkeypatch.setenv("GENLM_FAST_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "_convert", no_conversion)
    assert main(["demo", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "models")


# ---------------------------------------------------------------------------- model paths


def test_model_path_with_tilde(model_dir, tmp_path, monkeypatch):
    """``--model '~/x'`` (e.g. ``--model=~/x``, which the shell leaves alone) is a local
    directory: '~' is expanded before the directory is looked for."""
    from genlm_fast.demo import load_model

    monkeypatch.setenv("HOME", str(tmp_path))
    os.symlink(model_dir, tmp_path / "smol lm")
    llm = load_model("~/smol lm")
    try:
        assert len(llm.byte_vocab) == 49152
    finally:
        llm.cleanup()


def test_model_hub_id_from_the_hub_cache(model_dir, tmp_path):
    """A Hub id (``org/name``) in the Hub cache loads offline, as transformers loads it: an
    id with a '/' is not taken for a missing local directory."""
    snapshot = tmp_path / "hub" / "models--audit-org--tiny-smol" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--audit-org--tiny-smol" / "refs").mkdir()
    (tmp_path / "hub" / "models--audit-org--tiny-smol" / "refs" / "main").write_text("abc123")
    for name in os.listdir(model_dir):
        os.symlink(os.path.join(model_dir, name), snapshot / name)
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "GENLM_FAST_CACHE": str(tmp_path / "unused"),
    }
    code = (
        "from transformers import AutoConfig; "
        "print(AutoConfig.from_pretrained('audit-org/tiny-smol').model_type); "
        "from genlm_fast.demo import load_model; "
        "llm = load_model('audit-org/tiny-smol'); print(len(llm.byte_vocab)); llm.cleanup()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["llama", "49152"]  # transformers' own answer first


def test_cli_damaged_weights_is_a_clear_error(model_dir, tmp_path, capsys):
    """A model directory whose weights file is cut short: one line, exit status 2 (it used
    to be safetensors' traceback)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(model_dir):
        if name != "model.safetensors":
            os.symlink(os.path.join(model_dir, name), broken / name)
    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        (broken / "model.safetensors").write_bytes(f.read(1000))
    assert main(["demo", "--model", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "could not load model" in err and "broken" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_info_reports_what_runs(capsys):
    """`genlm-fast info`: the compiled backends, what `auto` picks for the trie kernels, and
    AsyncTransformer's CPU linear kernel, each as the library itself decides them."""
    from genlm_fast.backend.llm import cpu_linear
    from genlm_fast.ops import available_backends, extension

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"extension[cpu]: {'built' if extension.has('cpu') else 'not available'}" in out
    assert f"cpu: backends {available_backends('cpu')}; auto -> " in out
    chosen = cpu_linear.choose_kernel("auto") or "torch"
    assert f"AsyncTransformer CPU linear layers: {chosen} (kernels here: " in out
