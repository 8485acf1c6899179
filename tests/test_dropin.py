"""The drop-in import hook: genlm.backend / genlm.bytes resolve to genlm_fast, also after a
test suite clears sys.modules, in a fresh interpreter (as `pytest -p genlm_fast.dropin` runs)."""

import subprocess
import sys
import textwrap


def run(code):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_imports_resolve_to_genlm_fast_and_survive_sys_modules_cleanup():
    out = run("""
        import sys
        import genlm_fast.dropin
        import genlm.backend.trie as t
        from genlm.bytes import TokenByteTrie, TrieMode
        from genlm.backend.tokenization import Token, decode_vocab
        import genlm_fast.backend.trie, genlm_fast.bytes
        assert t.TokenCharacterTrie is genlm_fast.backend.trie.TokenCharacterTrie
        assert TokenByteTrie is genlm_fast.bytes.TokenByteTrie
        assert t.__spec__.name == "genlm_fast.backend.trie"  # its own spec is kept
        for name in [m for m in sys.modules if m.startswith("genlm")]:  # genlm's conftest does this
            if not name.startswith("genlm_fast"):
                del sys.modules[name]
        from genlm.bytes.trie import TrieMode as again
        assert again is TrieMode
        trie = TokenByteTrie([Token(0, b"a"), Token(1, b"ab")], device="cpu")
        print(float(trie.weight_sum([0.25, 0.75])[trie.root]))
        """)
    assert out.strip() == "1.0"


def test_other_genlm_packages_are_untouched_and_missing_modules_fail_cleanly():
    run("""
        import genlm_fast.dropin
        import genlm.control  # not aliased: genlm-control's own package
        assert genlm.control.__spec__.name == "genlm.control"
        assert "genlm_fast" not in genlm.control.__file__, genlm.control.__file__
        try:
            import genlm.backend.llm.mlx_does_not_exist
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("a module genlm_fast lacks must not import")
        """)


def test_uninstall_gives_genlm_back_also_after_a_reload():
    """One finder however often the module is reloaded, and uninstall() removes it: the
    next imports are genlm-backend's and genlm-bytes' own (installed as test extras)."""
    run("""
        import importlib, sys
        import genlm_fast.dropin as dropin
        import genlm.bytes
        assert genlm.bytes.__spec__.name == "genlm_fast.bytes"
        dropin = importlib.reload(dropin)
        importlib.reload(dropin)
        finders = [f for f in sys.meta_path if type(f).__name__ == "GenlmAliasFinder"]
        assert len(finders) == 1, finders
        dropin.uninstall()
        assert not [f for f in sys.meta_path if type(f).__name__ == "GenlmAliasFinder"]
        import genlm.bytes, genlm.backend.trie
        assert "genlm_fast" not in genlm.bytes.__file__, genlm.bytes.__file__
        assert "genlm_fast" not in genlm.backend.trie.__file__, genlm.backend.trie.__file__
        assert genlm.bytes.TokenByteTrie.__module__.startswith("genlm.bytes")
        """)


def test_pytest_plugin_form(tmp_path):
    (tmp_path / "test_x.py").write_text(
        textwrap.dedent("""
        def test_alias():
            import genlm.bytes, genlm_fast.bytes
            assert genlm.bytes.TokenByteTrie is genlm_fast.bytes.TokenByteTrie
        """)
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "genlm_fast.dropin",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_x.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_genlm_module_imports_or_says_why_not():
    """Walk genlm-backend's and genlm-bytes' modules (from the installed packages' files,
    without importing them) and import each one under the drop-in."""
    out = run("""
        import importlib, importlib.util, os, pkgutil, sys
        def walk(name, paths):
            yield name
            for info in pkgutil.iter_modules(paths):
                sub = f"{name}.{info.name}"
                if info.ispkg:
                    yield from walk(sub, [os.path.join(info.module_finder.path, info.name)])
                else:
                    yield sub
        names = [n for pkg in ("genlm.backend", "genlm.bytes")
                 for n in walk(pkg, importlib.util.find_spec(pkg).submodule_search_locations)]
        assert "genlm.backend.trie.parallel" in names and "genlm.bytes.byte_lm.beam" in names
        assert not [m for m in sys.modules if m.startswith("genlm.")]  # nothing of genlm ran

        import genlm_fast.dropin
        from genlm_fast.dropin import NOT_PROVIDED
        vllm_installed = importlib.util.find_spec("vllm") is not None
        for name in names:
            try:
                module = importlib.import_module(name)
            except ImportError as error:
                if name in NOT_PROVIDED:
                    assert "genlm_fast does not provide" in str(error), error
                else:
                    raise
            else:
                assert name not in NOT_PROVIDED, name
                assert module.__name__.startswith("genlm_fast."), (name, module.__name__)

        # as genlm's, the vLLM module imports without vllm; building the LM says why not
        from genlm.backend.llm.vllm import HAS_VLLM, AsyncVirtualLM
        assert HAS_VLLM is vllm_installed, HAS_VLLM
        if not vllm_installed:
            try:
                AsyncVirtualLM.from_name("gpt2")
            except ImportError as error:
                assert "vllm is not installed" in str(error), error
            else:
                raise AssertionError("AsyncVirtualLM.from_name ran without vllm")

        from genlm.backend.trie.parallel import ParallelTokenCharacterTrie
        import genlm_fast.backend.trie
        assert ParallelTokenCharacterTrie is genlm_fast.backend.trie.ParallelTokenCharacterTrie
        print("ok")
        """)
    assert out.strip() == "ok"


NAMESPACE_PROBE = """
    import json
    PREAMBLE
    import genlm.backend as backend, genlm.bytes as gbytes
    star = {}
    exec("from genlm.backend import *", star)
    exec("from genlm.bytes import *", star)
    print(json.dumps({
        "star": sorted(k for k in star if not k.startswith("__")),
        "submodules": [m for m in ("llm", "trie", "tokenization", "cache")
                       if hasattr(backend, m)],
        "llm_names": sorted(n for n in dir(backend.llm) if not n.startswith("_")),
    }))
"""


def test_package_namespaces_offer_what_genlm_offers():
    """``import genlm.backend`` then ``genlm.backend.llm.X``, and ``import *``, give at least
    what the real packages give (each side in its own interpreter)."""
    import json

    def probe(preamble):
        out = run(NAMESPACE_PROBE.replace("PREAMBLE", preamble))
        return json.loads(out.strip().splitlines()[-1])

    real, ours = probe("pass"), probe("import genlm_fast.dropin")
    assert set(real["star"]) <= set(ours["star"]), set(real["star"]) - set(ours["star"])
    assert real["submodules"] == ["llm", "trie", "tokenization", "cache"]
    assert ours["submodules"] == real["submodules"]
    wanted = {"AsyncLM", "AsyncTransformer", "AsyncVirtualLM", "MockAsyncLM", "load_model_by_name"}
    assert wanted <= set(real["llm_names"]) and wanted <= set(ours["llm_names"])


def test_dropin_after_genlm_warns():
    """Imported after genlm.control (which bound genlm.backend's real classes), the drop-in
    says so at once instead of letting the two implementations meet later."""
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "error::RuntimeWarning",
            "-c",
            "import genlm.control\nimport genlm_fast.dropin",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "imported after genlm.backend" in proc.stderr and "genlm.control" in proc.stderr
    run("""
        import warnings
        warnings.simplefilter("error")
        import genlm_fast.dropin, genlm.control  # the right order: no warning
        """)
