"""genlm_fast.models: where the SmolLM2 copy goes, and how its cache directory is kept safe.

The file-system tests replace the slow GGUF conversion (`smollm2._convert`) by a stub that
writes a tiny model directory; what they check is read back from the file system (files
present or not, modes, whether safetensors can load the weights), not from genlm_fast.
One slow test runs the real conversion into a temporary cache and compares the converted
model's logits with transformers reading the GGUF itself.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from genlm_fast import models
from genlm_fast.models import smollm2, store

SUBDIR = os.path.join("models", "smollm2-135m-instruct")


def fake_convert(calls=None, barrier=None):
    """Stand-in for the conversion: a tiny but complete model directory in ``work``,
    weights written 0600 as safetensors writes them."""
    import torch
    from safetensors.torch import save_file

    def convert(folder, gguf_file, work, bar, steps, show):
        if barrier is not None:
            barrier.wait(timeout=30)
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump({"model_type": "llama"}, f)
        with open(os.path.join(work, "tokenizer.json"), "w") as f:
            json.dump({}, f)
        weights = os.path.join(work, "model.safetensors")
        save_file({"w": torch.arange(6, dtype=torch.float32)}, weights)
        os.chmod(weights, 0o600)
        if calls is not None:
            calls.append(work)

    return convert


def loads(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))["w"].tolist() == list(range(6))


# ---------------------------------------------------------------------------- where


@pytest.mark.parametrize("xdg", ["", "relative/cache"])
def test_empty_or_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path, xdg):
    """XDG base-directory spec: an empty or relative $XDG_CACHE_HOME counts as unset."""
    monkeypatch.delenv("GENLM_FAST_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    root = os.path.join(str(tmp_path), ".cache", "genlm_fast")
    assert all_caches() == (
        os.path.join(root, SUBDIR),
        os.path.join(root, "tries"),
        os.path.join(root, "ext"),
    )


def all_caches():
    """The model's, the trie layouts' and the JIT builds' folders: one root for all three."""
    from genlm_fast.ops import extension, layout_cache

    return models.default_cache_dir(), layout_cache.default_cache_dir(), extension.cache_dir()


def test_cache_env_vars(monkeypatch, tmp_path):
    monkeypatch.setenv("GENLM_FAST_CACHE", str(tmp_path / "g"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert all_caches()[0] == os.path.join(str(tmp_path / "g"), SUBDIR)
    assert all_caches()[1:] == (str(tmp_path / "g" / "tries"), str(tmp_path / "g" / "ext"))
    monkeypatch.setenv("GENLM_FAST_CACHE", "")
    root = tmp_path / "x" / "genlm_fast"
    assert all_caches() == (os.path.join(str(root), SUBDIR), str(root / "tries"), str(root / "ext"))


# ---------------------------------------------------------------------------- never clobber


def test_existing_user_directory_is_not_overwritten(tmp_path, monkeypatch):
    """``smollm2_path(cache_dir=...)`` on a directory holding someone's files refuses,
    before converting anything, and leaves the files alone."""
    calls = []
    monkeypatch.setattr(smollm2, "_convert", fake_convert(calls))
    target = tmp_path / "my models"
    target.mkdir()
    (target / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a genlm_fast model directory"):
        models.smollm2_path(str(target), quiet=True)
    assert (target / "notes.txt").read_text() == "precious"
    assert calls == []
    assert sorted(os.listdir(tmp_path)) == ["my models"]  # no work directory left


def test_existing_file_is_not_overwritten(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "_convert", fake_convert())
    target = tmp_path / "model"
    target.write_text("a file")
    with pytest.raises(FileExistsError):
        models.smollm2_path(str(target), quiet=True)
    assert target.read_text() == "a file"


def test_empty_directory_and_unicode_path(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "_convert", fake_convert())
    target = tmp_path / "sp ace ü" / "empty"
    target.mkdir(parents=True)
    assert models.smollm2_path(str(target), quiet=True) == str(target)
    assert loads(str(target))


# ---------------------------------------------------------------------------- damaged caches


@pytest.mark.parametrize(
    "damage",
    [
        "truncate weights",
        "delete weights",
        "empty weights",
        "corrupt config",
        "delete config",
        "marker is a list",
    ],
)
def test_damaged_cache_is_converted_again(tmp_path, monkeypatch, damage):
    """A copy damaged after it was finished is not handed out: it is converted again."""
    calls = []
    monkeypatch.setattr(smollm2, "_convert", fake_convert(calls))
    target = str(tmp_path / "smol")
    assert models.smollm2_path(target, quiet=True) == target and len(calls) == 1
    assert models.smollm2_path(target, quiet=True) == target and len(calls) == 1  # cached
    weights = os.path.join(target, "model.safetensors")
    if damage == "truncate weights":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) - 4)
    elif damage == "delete weights":
        os.remove(weights)
    elif damage == "empty weights":
        open(weights, "w").close()
    elif damage == "corrupt config":
        with open(os.path.join(target, "config.json"), "w") as f:
            f.write('{"model_type": ')
    elif damage == "delete config":
        os.remove(os.path.join(target, "config.json"))
    else:
        with open(os.path.join(target, store._MARKER), "w") as f:
            f.write("[]")
    assert models.smollm2_path(target, quiet=True) == target
    assert len(calls) == 2
    assert loads(target)
    with open(os.path.join(target, "config.json")) as f:
        assert json.load(f) == {"model_type": "llama"}
    assert sorted(os.listdir(tmp_path)) == ["smol"]  # the damaged copy is gone, no leftovers


# ---------------------------------------------------------------------------- leftovers, races


def test_leftovers_of_killed_conversions_are_removed(tmp_path, monkeypatch):
    """A conversion killed half-way leaves its temporary directory (up to 538 MB); the next
    conversion removes it, unless its process still runs."""
    monkeypatch.setattr(smollm2, "_convert", fake_convert())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = __import__("socket").gethostname()
    for name, pid in ((".smol-killed", dead.pid), (".smol-running", os.getpid())):
        work = tmp_path / name
        work.mkdir()
        (work / "model.safetensors").write_bytes(b"\0" * 1000)  # half-written weights
        (work / ".genlm_fast_owner").write_text(json.dumps({"pid": pid, "host": host}))
    old = tmp_path / ".smol-from-an-older-version"  # no owner file, untouched for 2 h
    old.mkdir()
    (old / "config.json").write_text("{}")
    two_hours_ago = os.path.getmtime(old) - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    fresh = tmp_path / ".smol-just-started"  # no owner file yet, fresh: keep
    fresh.mkdir()
    target = str(tmp_path / "smol")
    assert models.smollm2_path(target, quiet=True) == target and loads(target)
    assert sorted(os.listdir(tmp_path)) == [".smol-just-started", ".smol-running", "smol"]


def test_concurrent_conversions_agree(tmp_path, monkeypatch):
    """Two conversions finishing at the same moment: both return the one finished copy."""
    barrier = threading.Barrier(2)
    monkeypatch.setattr(smollm2, "_convert", fake_convert(barrier=barrier))
    target = str(tmp_path / "smol")
    results, errors = [], []

    def run():
        try:
            results.append(models.smollm2_path(target, quiet=True))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and results == [target, target]
    assert loads(target) and sorted(os.listdir(tmp_path)) == ["smol"]


def test_permissions_follow_the_umask(tmp_path, monkeypatch):
    """mkdtemp makes 0700 directories and safetensors 0600 files; the finished copy gets
    the umask's permissions, so a shared $GENLM_FAST_CACHE is readable by its other users."""
    monkeypatch.setattr(smollm2, "_convert", fake_convert())
    target = str(tmp_path / "smol")
    old = os.umask(0o022)
    try:
        models.smollm2_path(target, quiet=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755
    for name in os.listdir(target):
        assert stat.S_IMODE(os.stat(os.path.join(target, name)).st_mode) == 0o644, name


def test_resolve_model_name(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "smollm2_path", lambda: "/the/copy")
    assert models.resolve_model_name("SmolLM2") == "/the/copy"
    assert models.resolve_model_name("genlm-fast/smollm2") == "/the/copy"
    assert models.resolve_model_name("gpt2") == "gpt2"
    assert models.resolve_model_name(str(tmp_path)) == str(tmp_path)


# ---------------------------------------------------------------------------- the real thing


@pytest.mark.slow
def test_real_conversion_matches_transformers_reading_the_gguf(tmp_path):
    """Convert into an empty cache (in a child process, as a user would), then compare the
    plain directory's logits with transformers' own de-quantization of the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = {**os.environ, "GENLM_FAST_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            ("from genlm_fast.models import smollm2_path; print(smollm2_path(quiet=True))"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    path = out.stdout.strip().splitlines()[-1]
    assert path == os.path.join(str(tmp_path), SUBDIR)
    assert sorted(os.listdir(os.path.join(str(tmp_path), "models"))) == ["smollm2-135m-instruct"]
    assert not os.path.exists(os.path.join(path, store._OWNER))

    folder, gguf = smollm2._gguf_source()
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        got = plain(ids).logits
        del plain
        ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
        assert ref.dtype == torch.float32
        expected = ref.eval()(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    tok = AutoTokenizer.from_pretrained(path)
    ref_tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    text = "The capital of France is Paris. ünïcödé"
    assert tok.encode(text) == ref_tok.encode(text) and len(tok) == len(ref_tok) == 49152
