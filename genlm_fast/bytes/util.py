"""Small helpers of the byte-level LM: next-byte distributions, ``Chart``, log-sum-exp.

Nothing here needs IPython, pandas or arsenal at import time: the notebook display
helpers (``format_table``, ``Chart._repr_html_``, ``Chart.compare``) import what they
need when they are called.
"""

from __future__ import annotations

import html
import operator

import numpy as np

EOT_INDEX = 256  # where a distribution over next bytes keeps end-of-token
EOS_INDEX = 257  # ... and end-of-sequence
NUM_SYMBOLS = 258  # 256 bytes, EOT, EOS


class ByteProbsLengthError(ValueError, AssertionError):
    """A next-symbol distribution without exactly 258 entries. Also an ``AssertionError``,
    which is what genlm-bytes raises for it (callers may catch either)."""


def as_index(value, what: str, hint: str = "") -> int:
    """``value`` as an int (anything with ``__index__`` except a bool). Otherwise a TypeError
    that starts with ``what`` (e.g. "K must be an int") and says what was given, then ``hint``."""
    if isinstance(value, bool):
        raise TypeError(f"{what}, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}, got {type(value).__name__}: {value!r}{hint}") from None


class LazyByteProbs:
    """A (log-)distribution over the next symbol: bytes 0..255, EOT and EOS.

    ``ps`` has 258 entries: ``ps[b]`` for byte ``b``, ``ps[256]`` for end of token (looked
    up with the key ``None``) and ``ps[257]`` for end of sequence.

    Args:
        ps (array-like): the 258 values.
        log_space (bool): whether they are log-probabilities (default) or probabilities.
    """

    def __init__(self, ps, log_space=True):
        if len(ps) != NUM_SYMBOLS:
            raise ByteProbsLengthError(
                f"LazyByteProbs needs {NUM_SYMBOLS} values (256 bytes, EOT, EOS), got {len(ps)}"
            )
        self.ps = ps
        self.log_space = log_space

    def __getitem__(self, b):
        """Value of byte ``b`` (0..255), ``None`` (EOT) or 257 (EOS); a negative ``b``
        counts from the end of ``ps``, as genlm-bytes reads it (-1 is EOS, -2 EOT)."""
        if b is None:
            return self.ps[EOT_INDEX]
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise TypeError(
                f"index with a byte (int 0..255), None for EOT or 257 for EOS; "
                f"got {type(b).__name__}: {b!r}"
            )
        if not -NUM_SYMBOLS <= b <= EOS_INDEX:
            raise ValueError(
                f"Invalid index: {b}. Must be between 0 and 257 (or -258 and -1 "
                f"from the end), or None for EOT."
            )
        return self.ps[int(b)]

    def materialize(self):
        """A ``Chart`` keyed by byte (0..255), ``None`` (EOT) and 257 (EOS)."""
        chart = Chart(-np.inf if self.log_space else 0)
        values = np.asarray(self.ps).tolist()
        for b in range(256):
            chart[b] = values[b]
        chart[None] = values[EOT_INDEX]
        chart[EOS_INDEX] = values[EOS_INDEX]
        return chart

    def pretty(self):
        """``materialize()`` with readable keys: ``b'a'``, ``'EOT'``, ``'EOS'``."""

        def label(key):
            if key is None:
                return "EOT"
            if key == EOS_INDEX:
                return "EOS"
            return bytes([key])

        return self.materialize().map_keys(label)

    def __repr__(self):
        kind = "log-probabilities" if self.log_space else "probabilities"
        return f"LazyByteProbs({kind} over 256 bytes + EOT + EOS)"


def logsumexp(arr):
    """``log(sum(exp(arr)))`` of a 1-D sequence, stable; ``-inf`` when empty or all ``-inf``."""
    a = np.asarray(arr, dtype=np.float64).ravel()
    a = a[a > -np.inf]
    if a.size == 0:
        return -np.inf
    top = a.max()
    if not np.isfinite(top):
        return top  # +inf or nan
    return float(top + np.log(np.exp(a - top).sum()))


def logsumexp_columns(rows):
    """Column-wise log-sum-exp of a ``[R, C]`` array (``-inf`` for all-``-inf`` columns)."""
    m = np.asarray(rows, dtype=np.float64)
    top = m.max(axis=0)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.exp(m - safe).sum(axis=0)) + safe
    return np.where(top == -np.inf, -np.inf, out)


def sample_dict(x, size=None, u=None):
    """Draw a key of ``x`` with probability proportional to its (non-negative) value.

    Inverse-CDF sampling with NumPy's global generator (seed it with ``np.random.seed``).
    """
    keys = list(x.keys())
    weights = np.cumsum(np.asarray(list(x.values()), dtype=np.float64))
    if not len(keys) or not weights[-1] > 0:
        raise ValueError("cannot sample from a distribution with no positive weight")
    if u is None:
        u = np.random.uniform(0, 1, size=size)
    pick = weights.searchsorted(np.asarray(u) * weights[-1])
    if np.ndim(pick) == 0:
        return keys[min(int(pick), len(keys) - 1)]
    return [keys[min(int(i), len(keys) - 1)] for i in np.ravel(pick)]


def _cell_html(x):
    """HTML for one table cell: rich objects render themselves, the rest as escaped text."""
    data = getattr(x, "data", None)
    if type(x).__name__ in ("SVG", "HTML") and isinstance(data, str):
        return data
    for name in ("_repr_html_", "_repr_svg_", "_repr_image_svg_xml"):
        method = getattr(x, name, None)
        if method is not None:
            out = method()
            if out is not None:
                return out
    return f"<pre>{html.escape(str(x))}</pre>"


def format_table(rows, headings=None):
    """An HTML ``<table>`` of ``rows`` (for notebooks)."""
    head = ""
    if headings:
        head = '<tr style="font-weight: bold;">' + "".join(f"<td>{h}</td>" for h in headings)
        head += "</tr>"
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell_html(c)}</td>" for c in row) + " </tr>" for row in rows
    )
    return f"<table>{head}{body}</table>"


class Chart(dict):
    """A dict with a default value (``zero``) and the arithmetic of a distribution.

    Missing keys read as ``zero``; ``+`` adds pointwise, ``*`` multiplies pointwise,
    ``normalize`` divides by the sum, ``argmax`` / ``top`` / ``sort_descending`` rank keys.

    Args:
        zero: the value of a missing key (``0`` for probabilities, ``-inf`` for logs).
        vals: initial ``(key, value)`` pairs or a mapping.
    """

    def __init__(self, zero, vals=()):
        self.zero = zero
        super().__init__(vals)

    def __missing__(self, key):
        return self.zero

    def spawn(self):
        """An empty chart with the same ``zero``."""
        return Chart(self.zero)

    def __add__(self, other):
        out = self.spawn()
        for source in (self, other):
            for k, v in source.items():
                out[k] += v
        return out

    def __mul__(self, other):
        out = self.spawn()
        for k in self:
            v = self[k] * other[k]
            if v != self.zero:
                out[k] += v
        return out

    def copy(self):
        return Chart(self.zero, self)

    def trim(self):
        """Without the entries equal to ``zero``."""
        return Chart(self.zero, {k: v for k, v in self.items() if v != self.zero})

    def metric(self, other):
        """Largest absolute difference over the keys of either chart."""
        if not isinstance(other, Chart):
            raise TypeError(f"metric compares two Charts, got {type(other).__name__}")
        return max((abs(self[k] - other[k]) for k in self.keys() | other.keys()), default=0)

    def _repr_html_(self):
        return (
            '<div style="font-family: Monospace;">'
            + format_table(self.trim().items(), headings=["key", "value"])
            + "</div>"
        )

    def __repr__(self):
        return repr({k: v for k, v in self.items() if v != self.zero})

    def __str__(self, style_value=lambda k, v: str(v)):
        lines = [
            f"  {k!r}: {style_value(k, self[k])},"
            for k in sorted(self, key=lambda k: -self[k])
            if self[k] != self.zero
        ]
        return "Chart {\n" + "\n".join(lines) + "\n}"

    def assert_equal(self, want, *, domain=None, tol=1e-5, verbose=False, throw=True):
        """Check ``|self[k] - want[k]| <= tol`` on ``domain`` (default: keys of either).

        Raises AssertionError on the first mismatch when ``throw``; prints every key when
        ``verbose``.
        """
        if not isinstance(want, Chart):
            want = Chart(self.zero, want)
        if domain is None:
            domain = self.keys() | want.keys()
        if not (verbose or throw):
            raise ValueError("assert_equal needs verbose=True or throw=True")
        bad = []
        for k in domain:
            ok = abs(self[k] - want[k]) <= tol
            if verbose:
                print("ok " if ok else "BAD", k, self[k], *(() if ok else (want[k],)))
            if not ok:
                bad.append(k)
        if throw and bad:
            k = bad[0]
            raise AssertionError(f"{k}: {self[k]} {want[k]}")

    def argmax(self):
        return max(self, key=self.__getitem__)

    def argmin(self):
        return min(self, key=self.__getitem__)

    def top(self, k):
        """The ``k`` largest entries, largest first."""
        keys = sorted(self, key=self.__getitem__, reverse=True)[:k]
        return Chart(self.zero, {key: self[key] for key in keys})

    def max(self):
        return max(self.values())

    def min(self):
        return min(self.values())

    def sum(self):
        return sum(self.values())

    def sort(self, **kwargs):
        return Chart(self.zero, [(k, self[k]) for k in sorted(self, **kwargs)])

    def sort_descending(self):
        return Chart(self.zero, [(k, self[k]) for k in sorted(self, key=lambda k: -self[k])])

    def normalize(self):
        total = self.sum()
        if total == 0:
            return self
        return Chart(self.zero, [(k, v / total) for k, v in self.items()])

    def filter(self, f):
        return Chart(self.zero, [(k, v) for k, v in self.items() if f(k)])

    def map_values(self, f):
        return Chart(f(self.zero), [(k, f(v)) for k, v in self.items()])

    def map_keys(self, f):
        return Chart(self.zero, [(f(k), v) for k, v in self.items()])

    def project(self, f):
        """Re-key by ``f``; values of keys that collide are added."""
        out = self.spawn()
        for k, v in self.items():
            out[f(k)] += v
        return out

    def compare(self, other, *, domain=None):
        """A pandas DataFrame of ``self[k]``, ``other[k]`` and their distance (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - pandas is optional
            raise ImportError("Chart.compare needs pandas: pip install pandas") from e
        if not isinstance(other, Chart):
            other = Chart(self.zero, other)
        if domain is None:
            domain = self.keys() | other.keys()
        return pd.DataFrame(
            [
                {"key": k, "self": self[k], "other": other[k], "metric": abs(self[k] - other[k])}
                for k in domain
            ]
        )

    def to_dict(self):
        return dict(self)


def escape(x):
    """Printable form of a byte (int), bytes or str, with spaces shown as ``␣``."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        x = bytes([int(x)]) if 0 <= x <= 255 else str(int(x))
    text = repr(x)[2:-1] if isinstance(x, bytes) else repr(x)[1:-1]
    return text.replace(" ", "␣")


def format_byte(byte_val) -> str:
    """``b'A'`` for a byte 0..255; the number itself for 256 (EOT), 257 (EOS) or anything else."""
    try:
        if 0 <= byte_val <= 255:
            return repr(bytes([byte_val]))
    except TypeError:
        pass
    return str(byte_val)
