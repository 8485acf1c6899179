"""How much more memory this process may take, checked before a packed copy of the weights is
made: running out of memory must not be how a user learns that a model is too big.

The room is the least of the system's available memory (``MemAvailable`` in /proc/meminfo: free
memory plus the page cache and buffers the kernel can reclaim) and, inside a memory-limited
cgroup (a container, a CI job), the limit less what the cgroup already uses (v2
``memory.max`` / ``memory.current``, v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``).
Where neither can be read (not Linux), the room is unknown and nothing is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Room", "room", "shortfall"]

MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
MARGIN = 1.1  # what a copy needs, with room to spare for what comes with it
_GB = 1e9


@dataclass(frozen=True)
class Room:
    """The memory this process may still take: ``bytes`` (None: unknown) and ``source``,
    which limit that is, in words."""

    bytes: int | None
    source: str


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _mem_available():
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room():
    """(limit - usage, limit) of this process's cgroup, or None without a limit."""
    group = ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and (parts[0] == "0" or "memory" in parts[1].split(",")):
                    group = parts[2]
                    break
    except OSError:
        pass
    for base in (os.path.join(CGROUP_ROOT, group.lstrip("/")), CGROUP_ROOT):
        for limit_name, usage_name in (
            ("memory.max", "memory.current"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            limit = _read_int(os.path.join(base, limit_name))
            usage = _read_int(os.path.join(base, usage_name))
            if limit is not None and usage is not None and limit < 1 << 60:
                return max(0, limit - usage), limit
    return None


def room() -> Room:
    """The memory this process may still take, and which limit sets it."""
    available = _mem_available()
    cgroup = _cgroup_room()
    if cgroup is not None and (available is None or cgroup[0] < available):
        left, limit = cgroup
        return Room(
            left, f"the cgroup's memory limit ({limit / _GB:.2f} GB) leaves {left / _GB:.2f} GB"
        )
    if available is not None:
        return Room(available, f"MemAvailable is {available / _GB:.2f} GB")
    return Room(None, "the available memory is unknown here")


def shortfall(need: int, what: str) -> str | None:
    """Why ``need`` bytes for ``what`` do not fit in the memory this process may still take
    (with a margin of `MARGIN`), naming both; None if they fit or the room is unknown."""
    have = room()
    if have.bytes is None or need * MARGIN <= have.bytes:
        return None
    return f"{what} would take {need / _GB:.2f} GB, and {have.source}"
