"""Process facts from Linux's /proc, without psutil: trees, CPU time, RSS, pinning.

CPU time comes from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds on CPU, per
thread) rather than ``stat``'s utime+stime, whose 10 ms ticks are too coarse for a
run that costs a gateway a fraction of a second. A gateway is measured as its whole
process tree (a ``--workers N`` supervisor and its workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
from pathlib import Path

__all__ = [
    "busy_seconds",
    "cpu_seconds",
    "new_loop",
    "pin",
    "raise_nofile",
    "rss_bytes",
    "steal_seconds",
    "tree",
]

_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (from each process's parent in /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after it.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def cpu_seconds(pids: list[int]) -> float:
    """CPU time used so far by every thread of ``pids``, in seconds."""
    total = 0.0
    for pid in pids:
        for tid in _tasks(pid):
            try:
                fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                total += int(fields[0]) / 1e9
            except (OSError, IndexError):
                with contextlib.suppress(OSError, IndexError):
                    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                    rest = stat[stat.rindex(")") + 2 :].split()
                    total += (int(rest[11]) + int(rest[12])) / _TICK
    return total


def steal_seconds(cpus: set[int] | None) -> float:
    """Time the hypervisor gave ``cpus`` (None: all) to someone else, from /proc/stat.

    On a shared virtual machine a run whose CPUs were stolen from is slower for reasons
    that have nothing to do with what it measures; the harness records it per run.
    """
    total = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu" or len(fields) < 8:
                continue
            if cpus is None or int(name[3:]) in cpus:
                total += int(fields[7])
    return total / _TICK


def busy_seconds() -> float:
    """CPU time the whole host spent on anything but idling (or waiting for I/O), every CPU,
    from /proc/stat: what a run's own processes took subtracted, what other jobs took."""
    total = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu" and len(fields) >= 8:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                total += user + nice + system + irq + softirq + steal
    return total / _TICK


def rss_bytes(pids: list[int]) -> int:
    """Resident set size of ``pids``, summed (shared pages count once per process)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    return total


def pin(pids: list[int], cpus: set[int] | None) -> None:
    """Pin every thread of ``pids`` to ``cpus`` (None: leave them where they are).

    ``sched_setaffinity(pid)`` moves one thread only, so each task is pinned; threads
    started later inherit the mask of the thread that starts them.
    """
    if not cpus:
        return
    for pid in pids:
        for tid in _tasks(pid):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)


def raise_nofile() -> int:
    """Raise this process's open-file limit to its hard limit (5,000 streams need ~10,000)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
    return soft


def new_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is importable, else asyncio's.

    The load side (upstream, load generator) is not under test: the less CPU it needs
    per chunk, the less it takes from what it measures. The raw proxy uses it to run
    on the same loop as ``nexus serve``, which picks uvloop where it is installed.
    """
    try:
        import uvloop  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
