"""torch's CPU threads while other processes compete for the CPUs.

torch splits every op over its intra-op threads in a fork-join region (the ops of a forward
pass, and every op on a vocabulary-sized row). When another process keeps one of the CPUs
busy, one of those threads waits for a CPU in every region, and the region waits a scheduler
time slice for it. On a machine with few CPUs, one busy process beside it makes a forward
on all the CPUs slower than on the ones left free, and the small ops between forward passes,
each a region that waits for a CPU, can cost more than the forwards (``python -m
bench.contention`` measures both).

So `follow_contention`, called before each CPU forward of `AsyncTransformer`, sets torch's
intra-op threads in the calling thread to the CPUs other work leaves free, capped by the
user's own setting (``csrc/cpu_threads.h``: the CPUs this process may use, by affinity and
cgroup quota, less those other processes kept busy over a recent window; the compiled
kernels size their own teams the same way). The setting stays until the next call, so that
the ops between forwards (in the byte beam, in genlm-control's samplers) run on it too, and
goes back to the user's when the CPUs are free again (the kernels' teams, capped by torch's
setting, follow it too). A user who sets another thread count meanwhile
(``torch.set_num_threads``) makes that the new cap. The thread count is the
calling thread's own (OpenMP's), so other threads keep theirs. Without the compiled kernels
nothing is changed.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["follow_contention", "restore_threads", "threads_info"]

# per thread: [the user's setting, the count last set here (None: none yet)]
_state = threading.local()


def _module():
    from genlm_fast.ops import extension

    return extension.load_module() if extension.has("cpu") else None


def follow_contention() -> int:
    """Set torch's intra-op threads in this thread to ``min(user's setting, free CPUs)``;
    returns the count in force."""
    module = _module()
    current = torch.get_num_threads()
    if module is None:
        return current
    user, ours = getattr(_state, "threads", (current, None))
    if ours is None or current != ours:  # first call, or the user set it since
        user = current
    want = max(1, min(user, int(module.cpu_free_cpus())))
    if want != current:
        torch.set_num_threads(want)
    _state.threads = (user, want)
    return want


def restore_threads() -> None:
    """Give this thread back the user's setting, if `follow_contention` lowered it."""
    user, ours = getattr(_state, "threads", (None, None))
    if ours is not None and torch.get_num_threads() == ours and ours != user:
        torch.set_num_threads(user)
    _state.threads = (user, None)


def threads_info() -> dict | None:
    """What the team sizes are decided from (``affinity_cpus``, ``quota_cpus``,
    ``usable_cpus``, ``others_busy``, ``free_cpus``, ``torch_threads``,
    ``contention_known``), or None without the compiled kernels."""
    module = _module()
    return None if module is None else dict(module.cpu_threads_info())
