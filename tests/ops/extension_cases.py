"""What the tests of the compiled CPU trie kernels (``csrc/``, module ``genlm_fast._C``)
share (test_extension_build.py and test_extension_numerics.py): small layouts by name, random
values, the float64 plain-torch reference they are compared with, and the raw extension entry
point with the arrays it takes.
"""

from __future__ import annotations

import numpy as np
import torch

from genlm_fast.ops import cpu_backend, extension, trie_reduce
from tests.layouts import make_layout, random_words

MODES = ["without_eos", "with_eos"]
REDUCTIONS = ["sum", "max", "log_mass"]


_LAYOUTS = {}


def layout_named(name):
    if name not in _LAYOUTS:
        rng = np.random.default_rng(99)
        if name == "one":
            _LAYOUTS[name] = make_layout([b"a"], eos_positions=[0])
        elif name == "seven":
            _LAYOUTS[name] = make_layout(
                [b"ab", b"a", b"", b"abc", b"b", b"ab", b"ba"], eos_positions=[2, 4]
            )
        elif name == "random":
            words = random_words(rng, 300)
            _LAYOUTS[name] = make_layout(words, rng.choice(len(words), 5, replace=False))
        elif name == "permuted":  # token columns: a permutation inside a wider row
            words = random_words(rng, 150, alphabet=b"xyz", max_len=9)
            cols = rng.permutation(len(words) + 40)[: len(words)]
            _LAYOUTS[name] = make_layout(words, eos_positions=[0, 3], token_column=cols)
        elif name == "big":  # > 32768 nodes: B < threads takes the split-row path
            words = random_words(rng, 7000, alphabet=b"abcdefghijklmnop", max_len=10)
            _LAYOUTS[name] = make_layout(words, rng.choice(len(words), 7, replace=False))
        else:
            raise KeyError(name)
    return _LAYOUTS[name]


def reference(values, layout, reduction, mode):
    return trie_reduce(values, layout, reduction, mode, backend="reference")[0]


def assert_matches(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    tol = 1e-12 if out.dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def random_values(rng, layout, B, reduction, dtype=torch.float32, extra_columns=0):
    C = layout.num_columns + extra_columns
    x = torch.from_numpy(rng.standard_normal((B, C)) * 3)
    if reduction == "sum":
        x = x.abs()
    return x.to(dtype)


def raw_cpu(layout, mode="without_eos"):
    """The raw extension entry point and the arrays it takes."""
    arrays = layout.device_arrays(mode, "cpu", "cpu")
    cpu = cpu_backend.cpu_arrays(arrays)
    module = extension.load_module()
    return module, arrays, cpu
