"""Where a program's time goes: a thread that reads the main thread's stack every
millisecond and counts each sample under one category (``PROFILE_COLUMNS``): the model's
forward, the rest of the LM layer, the tries, the byte beam, genlm-control and
genlm-grammar's own Python, waiting on the event loop, and the rest. Each sample goes to the
innermost frame that one of ``RULES`` matches; genlm's and genlm_fast's code are sorted
alike, so the two implementations' profiles compare.

    with StackSampler(loop=loop) as sampler:
        loop.run_until_complete(program())
    sampler.shares()   # {category: share of the samples}
"""

from __future__ import annotations

import sys
import threading

# (category, path fragment, function names or None for any): a frame belongs to the first
# rule that matches its file path (and function). "LM forward" is the forward pass: the
# model's code, and the backend code that builds its batch and stores its states (any module
# of genlm_fast's llm package but the interface, the batcher and the checks; genlm's
# ``_evaluate_queries`` and its helpers); "LM backend" is the rest of the LM layer (queueing,
# batching, output caches). A sample goes to the innermost frame that some rule matches.
_GENLM_FORWARD = {
    "_evaluate_queries",
    "batch_evaluate_queries",
    "past_padded",
    "prompt_padded",
    "attention_mask",
    "position_ids",
    "cache_kv",
    "next_token_logprobs_uncached",
}
_FAST_LM_LAYER = (
    "/genlm_fast/backend/llm/base.py",
    "/genlm_fast/backend/llm/batched.py",
    "/genlm_fast/backend/llm/batcher.py",
    "/genlm_fast/backend/llm/checks.py",
    "/genlm_fast/backend/llm/cache_view.py",
    "/genlm_fast/backend/llm/mock.py",
    "/genlm_fast/backend/cache.py",
)
RULES = (
    *(("LM backend", fragment, None) for fragment in _FAST_LM_LAYER),
    ("LM forward", "/genlm_fast/backend/llm/", None),
    ("LM forward", "/genlm/backend/llm/hf.py", _GENLM_FORWARD),
    ("LM forward", "/transformers/", None),
    ("LM forward", "/torch/nn/", None),
    ("LM backend", "/genlm/backend/llm/", None),
    ("LM backend", "/genlm/backend/cache", None),
    ("trie", "/genlm/backend/trie/", None),
    ("trie", "/genlm/bytes/trie", None),
    ("trie", "/genlm_fast/backend/trie/", None),
    ("trie", "/genlm_fast/bytes/trie", None),
    ("trie", "/genlm_fast/trie_core", None),
    ("trie", "/genlm_fast/ops/", None),
    ("byte beam", "/genlm/bytes/", None),
    ("byte beam", "/genlm_fast/bytes/", None),
    ("genlm-control", "/genlm/control/", None),
    ("genlm-control", "/genlm/grammar/", None),
    ("genlm-control", "/arsenal/", None),
    ("waiting", "/selectors.py", None),  # the event loop polling for I/O (see StackSampler)
)
PROFILE_COLUMNS = [
    "LM forward",
    "LM backend",
    "trie",
    "byte beam",
    "genlm-control",
    "waiting",
    "other",
]


def _category(frame, cache):
    while frame is not None:
        code = frame.f_code
        found = cache.get(code)
        if found is None:
            found = ""
            for name, fragment, functions in RULES:
                if fragment in code.co_filename and (
                    functions is None or code.co_name in functions
                ):
                    found = name
                    break
            cache[code] = found
        if found:
            return found
        frame = frame.f_back
    return "other"


class StackSampler:
    """Counts, every ``interval`` seconds, which category the main thread is in.

    With ``loop`` (the asyncio loop the programs run on), its selector's ``select`` is
    watched: a sample there counts as ``waiting`` only while the call may block (a
    timeout that is not 0: the loop has nothing to run until a timer, such as a batch's,
    runs out); the loop's non-blocking polls between callbacks count as ``other``."""

    def __init__(self, interval=0.001, loop=None):
        self.interval = interval
        self.counts = dict.fromkeys(PROFILE_COLUMNS, 0)
        self._stop = threading.Event()
        self._target = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._switch = None
        self._selector = getattr(loop, "_selector", None)
        self._blocking = False

    def _run(self):
        cache = {}
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._target)
            if frame is not None:
                category = _category(frame, cache)
                if category == "waiting" and not self._blocking:
                    category = "other"
                self.counts[category] += 1

    def _watched_select(self, timeout=None):
        self._blocking = timeout is None or timeout > 0
        try:
            return type(self._selector).select(self._selector, timeout)
        finally:
            self._blocking = False

    def __enter__(self):
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval / 2)  # let the sampler in during pure Python
        if self._selector is not None:
            self._selector.select = self._watched_select
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self._selector is not None:
            del self._selector.select
        sys.setswitchinterval(self._switch)

    def shares(self):
        total = sum(self.counts.values()) or 1
        return {name: count / total for name, count in self.counts.items()}
