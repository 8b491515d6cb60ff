"""The CPU the TorchServe frontend's JIT compilers use: the frontend is warm when they are quiet.

A fresh JVM runs the frontend's request path interpreted, then compiled by C1, then by C2. C2 keeps a
core busy for the first tens of seconds of a load (on 2 vCPUs serving MiniLM at ~1000 req/s: 0.48 of a
core in the first 5 s, 0.23 in the next, under 0.02 from about 20 s on), CPU the model's workers do
not get. A load measured before then is a figure of the server's first half-minute, not of its life.

Compiler threads are named by HotSpot ("C2 CompilerThread0", "C1 CompilerThre…": /proc truncates
names to 15 characters); their CPU comes from /proc/<pid>/task/<tid>/stat. None where /proc is not
readable (not Linux, the JVM gone). `process_cpu_s` is the whole JVM's CPU: less the compilers', it is the
frontend's own request work, which says how much a compiler still busy costs the served rate.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

COMPILER_PREFIXES = ("C1 CompilerThre", "C2 CompilerThre")


def compiler_cpu_s(pid: Optional[int]) -> Optional[float]:
    """CPU seconds (user + system) the JVM `pid`'s JIT compiler threads have used so far."""
    if not pid:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, seen = 0, False
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            if not (task / "comm").read_text().startswith(COMPILER_PREFIXES):
                continue
            ticks = _stat_ticks(task / "stat")
        except OSError:
            continue               # a compiler thread may end between the listing and the read
        total += ticks
        seen = True
    return total / tick if seen else 0.0


def _stat_ticks(stat: Path) -> int:
    """utime + stime, in clock ticks, of a /proc .../stat file (raises OSError where unreadable)."""
    # Fields after the parenthesised name: state is 3rd, utime 14th, stime 15th of the whole line.
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def process_cpu_s(pid: Optional[int]) -> Optional[float]:
    """CPU seconds (user + system) the whole process `pid` has used so far; None where unreadable."""
    if not pid:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        return _stat_ticks(Path(f"/proc/{pid}/stat")) / tick
    except OSError:
        return None
