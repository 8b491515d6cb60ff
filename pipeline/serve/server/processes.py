"""A server's processes on this host: free loopback ports, which processes belong to a server
(its working dir, TEMP or command line), their peak memory. Shared by TorchServe and Ray Serve."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

import psutil

from pipeline.serve.server.torchserve_http import HOST


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held open together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def processes_of(workdir: Path) -> list[psutil.Process]:
    """Live java/worker processes belonging to the server rooted at `workdir`: their cwd, TEMP or
    command line points inside it."""
    root = str(Path(workdir).resolve())
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        if proc.pid == os.getpid():
            continue
        try:
            cwd = proc.info.get("cwd") or ""
            cmd = " ".join(proc.info.get("cmdline") or [])
            mine = _inside(cwd, root) or root + os.sep in cmd or cmd.endswith(root)
            if not mine:
                env = proc.environ()
                mine = any(_inside(env.get(k, ""), root) for k in ("TEMP", "TMPDIR"))
            if mine and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def process_peak_rss_mb(pid: int) -> Optional[float]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024.0, 1)      # kB
    except OSError:
        pass
    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except psutil.Error:
        return None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
