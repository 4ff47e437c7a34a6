"""Helpers for the Ray security tests: the listening sockets of a process tree, a bounded
``slotune serve`` child."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str  # the process title: "raylet", "ray::ServeReplica:app:Dep", ...
    ip: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip.removeprefix("::ffff:")).is_loopback


def listeners(root_pid: int) -> list[Listener]:
    """Every listening TCP socket of ``root_pid`` and all its descendants."""
    root = psutil.Process(root_pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(p.cmdline()[:1]) or p.name()
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out.append(Listener(p.pid, os.path.basename(name), c.laddr.ip, c.laddr.port))
        except psutil.NoSuchProcess:  # a worker that exited while we looked
            continue
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    """This environment without Ray's address and token settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def start_serve(env: dict[str, str], *, run_for_s: float) -> tuple[subprocess.Popen[str], str]:
    """``slotune serve`` (tiny model) in a child; returns it and its stdout once it serves.

    The child stops by itself after ``run_for_s``; raises if it has not served in 180 s.
    """
    port, metrics = free_port(), free_port()
    err = tempfile.TemporaryFile("w+")  # Ray's logs: a file, never a full pipe
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller", "serve", "--port", str(port)]
        + ["--metrics-port", str(metrics), "--for", str(run_for_s)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 180
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("ray: "):  # the last line printed before it blocks
            return proc, "".join(lines)
    stop(proc)
    err.seek(0)
    raise AssertionError(f"slotune serve did not come up: {''.join(lines)}{err.read()[-3000:]}")


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM (slotune serve shuts Ray down on it), then SIGKILL after 60 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
