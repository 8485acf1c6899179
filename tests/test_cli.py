"""The command line (``genlm-fast demo`` / ``info``, genlm_fast.__main__) on the real
SmolLM2-135M-Instruct: ``main(["demo", ...])`` prints every section and returns 0; a model
path that does not exist, a directory that is not a model, damaged weights, a device that
cannot run the model and bad options each give a one-line error and exit status 2 before
anything runs; model paths with a tilde or a hub id resolve. The demo's numbers are in
test_demo.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from genlm_fast.__main__ import main
from genlm_fast.demo import demo
from tests.cli_fixtures import cli_environment as cli_environment  # autouse
from tests.cli_fixtures import model_dir as model_dir  # a fixture

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


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
