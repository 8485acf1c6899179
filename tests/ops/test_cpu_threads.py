"""Team sizes of the compiled CPU kernels (csrc/cpu_threads.h) and torch's threads around a
CPU forward (genlm_fast.backend.llm.threads).

Checked against what the operating system says, read here independently: the affinity mask
(os.sched_getaffinity), the cgroup's CPU quota (v1 or v2 files), and a competing process of
our own making, pinned to one of two CPUs this test's process is pinned to.
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from genlm_fast.ops import extension
from tests.ops.devices import cpu_extension_required as cpu_extension_required  # autouse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    return extension.load_module()


def _read(path):
    with open(path) as f:
        return f.read()


def _quota_here():
    """The smallest CPU quota on this process's cgroup path or its ancestors, or 0."""
    best = 0.0

    def consider(path):
        nonlocal best
        q = 0.0
        try:
            if path.endswith("cpu.max"):
                quota, period = _read(path).split()
                q = 0.0 if quota == "max" else float(quota) / float(period)
            else:
                quota = float(_read(path + "/cpu.cfs_quota_us"))
                period = float(_read(path + "/cpu.cfs_period_us"))
                q = quota / period if quota > 0 else 0.0
        except (OSError, ValueError):
            return
        if q > 0 and (best == 0 or q < best):
            best = q

    for line in _read("/proc/self/cgroup").splitlines():
        hier, controllers, path = line.split(":", 2)
        parts = [p for p in path.split("/") if p]
        prefixes = ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]
        for prefix in prefixes:
            prefix = prefix.rstrip("/")
            if hier == "0" and controllers == "":
                consider(f"/sys/fs/cgroup{prefix}/cpu.max")
            elif "cpu" in controllers.split(","):
                for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                    consider(f"/sys/fs/cgroup/{mount}{prefix}")
    return best


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_usable_cpus_follow_affinity_and_quota():
    info = _module().cpu_threads_info()
    affinity = len(os.sched_getaffinity(0))
    assert info["affinity_cpus"] == affinity
    quota = _quota_here()
    assert info["quota_cpus"] == pytest.approx(quota)
    usable = min(affinity, max(1, math.floor(quota))) if quota else affinity
    assert info["usable_cpus"] == usable
    assert 1 <= info["free_cpus"] <= usable


def test_team_size_is_bounded_by_the_work_and_torch():
    module = _module()
    threads = torch.get_num_threads()
    try:
        assert module.cpu_team_size(0) == 1
        assert module.cpu_team_size(256 << 10) == 1  # one thread's worth of work
        big = module.cpu_team_size(1 << 40)
        assert 1 <= big <= min(threads, module.cpu_free_cpus())
        torch.set_num_threads(1)
        assert module.cpu_team_size(1 << 40) == 1
    finally:
        torch.set_num_threads(threads)


_CHILD = textwrap.dedent("""
    import json, os, subprocess, sys, time
    cpus = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, cpus)  # before the kernels read it
    import torch
    torch.set_num_threads(2)
    from genlm_fast.ops import extension
    from genlm_fast.backend.llm import threads
    module = extension.load_module()

    def settle():  # a few readings, the last over the last 120 ms
        for _ in range(6):
            time.sleep(0.12)
            module.cpu_free_cpus()
        follows = threads.follow_contention()
        return dict(module.cpu_threads_info(), team=module.cpu_team_size(1 << 40),
                    torch_follows=follows, torch_now=torch.get_num_threads())

    before = settle()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(busy.pid, cpus[1:])
    try:
        during = settle()
    finally:
        busy.kill()
        busy.wait()
    after = settle()
    print(json.dumps({"before": before, "during": during, "after": after}))
""")


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
    reason="contention needs two CPUs to share",
)
def test_a_busy_neighbour_takes_a_cpu_from_the_team_and_gives_it_back():
    """A process pinned to two CPUs, beside a busy loop pinned to one of them: the kernels'
    team and torch's threads (after follow_contention) drop to one, and follow the reading
    back when the loop ends. Whatever else loads the machine, the busy loop alone keeps its
    CPU busy for others (this process sleeps), so the reading during it is at least most of a
    CPU; in every phase the team and torch's threads are what the reading gives by the rule
    (csrc/cpu_threads.cpp: a CPU is free while others keep less than 0.65 of it busy), so
    that with the loop gone and nothing else running they are two again."""
    import json

    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    )
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
        check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    before, during, after = r["before"], r["during"], r["after"]
    assert before["affinity_cpus"] == 2 and before["contention_known"]
    assert during["others_busy"] > 0.8, r  # the busy loop's own CPU
    assert during["free_cpus"] == 1 and during["team"] == 1, r
    assert during["torch_follows"] == 1 and during["torch_now"] == 1, r
    for phase in (before, during, after):
        free = max(1, min(phase["usable_cpus"], math.floor(2 - phase["others_busy"] + 0.35)))
        assert phase["free_cpus"] == free, r
        assert phase["team"] == free and phase["torch_follows"] == phase["torch_now"] == free, r


def test_follow_contention_keeps_the_users_setting_as_its_cap(monkeypatch):
    from genlm_fast.backend.llm import threads

    threads_before = torch.get_num_threads()
    free = {"n": 1}

    class Fake:
        def cpu_free_cpus(self):
            return free["n"]

    monkeypatch.setattr(threads, "_module", lambda: Fake())
    try:
        torch.set_num_threads(2)
        threads.restore_threads()
        assert threads.follow_contention() == 1 and torch.get_num_threads() == 1
        free["n"] = 4  # CPUs free again: back to the user's 2, not 4
        assert threads.follow_contention() == 2 and torch.get_num_threads() == 2
        free["n"] = 1
        threads.follow_contention()
        torch.set_num_threads(3)  # the user's own change becomes the cap
        free["n"] = 8
        assert threads.follow_contention() == 3
        free["n"] = 1
        assert threads.follow_contention() == 1
        threads.restore_threads()
        assert torch.get_num_threads() == 3
    finally:
        threads.restore_threads()
        torch.set_num_threads(threads_before)
