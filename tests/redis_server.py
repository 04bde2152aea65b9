"""A private redis-server for the store tests: on a unix socket under a temp dir (and a TCP port
when asked), no persistence, a small maxmemory with allkeys-lru. Never the machine's 6379."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REDIS = shutil.which("redis-server")
SKIP_REASON = ("redis-server is not installed (apt-get install -y redis-server; .ci/run installs it): "
               "the Redis backend's tests need a real server")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """`redis-server` as a child process; `url` is its unix socket (or TCP when `port` is given)."""

    def __init__(self, maxmemory: str = "256mb", port: int = 0, bind: str = "127.0.0.1", netns: str | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="rc-redis-"))
        self.sock = self.dir / "redis.sock"
        self.port, self.bind, self.netns, self.maxmemory = port, bind, netns, maxmemory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Its TCP address when it has a port (one bind address), else its unix socket."""
        return f"redis://{self.bind}:{self.port}/0" if self.port else self.unix_url

    @property
    def unix_url(self) -> str:
        return f"unix://{self.sock}?db=0"

    def start(self) -> "RedisServer":
        cmd = [REDIS, "--port", str(self.port), "--bind", self.bind, "--unixsocket", str(self.sock),
               "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(self.dir),
               "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no"]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns] + cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {' '.join(cmd)}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
