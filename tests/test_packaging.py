"""What the checkout puts on the import path: one product package, nothing that shadows
another distribution's top-level name."""

from __future__ import annotations

import os

from setuptools import find_packages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the product, and the development trees that import it (never the reverse)
TOP_LEVEL = {"genlm_fast", "bench", "tests", "tools"}


def test_the_checkout_root_holds_no_other_package():
    """Anything run from the checkout (pytest, ``python -m bench...``) has the root on
    sys.path, so a top-level package there hides the installed one of the same name: a
    folder ``kernels/`` made transformers and bitsandbytes import it instead of the
    Hugging Face ``kernels`` distribution."""
    found = {
        name for name in os.listdir(REPO) if os.path.isfile(os.path.join(REPO, name, "__init__.py"))
    }
    assert found <= TOP_LEVEL, sorted(found - TOP_LEVEL)


def test_the_triton_kernels_are_part_of_the_package():
    """setup.py installs ``find_packages(include=["genlm_fast", "genlm_fast.*"])``: the
    Triton kernels must be among them, with no mapping of their own."""
    packages = find_packages(REPO, include=["genlm_fast", "genlm_fast.*"])
    assert "genlm_fast.kernels" in packages
    assert os.path.isfile(os.path.join(REPO, "genlm_fast", "kernels", "trie_reduce.py"))
