"""Two vLLM engines on two "hosts" that share nothing but a Redis address hand a conversation off.

The source engine and the target engine run in separate processes (tests/vllm_host.py), each
given only `redis://ADDRESS/0` as its row store. Where network namespaces can be made (root, or
CAP_NET_ADMIN), each engine runs in a namespace of its own and Redis in a third, reachable from
each engine only over a veth pair; otherwise the processes share the loopback, and the test says
so (a warning and the `hosts` property in the report). The harness (this process) reaches the
same server over its unix socket to evict entries and to stop it.

At ρ = 1 the target's greedy tokens equal the target alone's; with the entry evicted, and then
with Redis stopped, the request is answered by the target's own prefill and reports
`fallback_reprefill` with the reason (`evicted`, `store_down`). One engine start each (the
source, then the target), about a minute each here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest

from .redis_server import REDIS, SKIP_REASON, RedisServer, free_port
from .test_vllm import BS, HAVE_VLLM, vpair  # noqa: F401 - the tiny pair and its map, as test_vllm.py builds them

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'rarecache[vllm]')"),
              pytest.mark.skipif(REDIS is None, reason=SKIP_REASON)]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    """Three namespaces (source, target, redis) and two veth pairs; or, failing that, the loopback."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.ns = {"src": f"rc{tag}s", "tgt": f"rc{tag}t", "redis": f"rc{tag}r"}
        self.addr = {"src": ("10.231.1.1", "10.231.1.2"), "tgt": ("10.231.2.1", "10.231.2.2")}
        try:
            for ns in self.ns.values():
                _ip("netns", "add", ns)
            for side, (far, near) in self.addr.items():
                a, b = f"rc{tag}{side[0]}0", f"rc{tag}{side[0]}1"
                _ip("link", "add", a, "type", "veth", "peer", "name", b)
                _ip("link", "set", a, "netns", self.ns["redis"])
                _ip("link", "set", b, "netns", self.ns[side])
                _ip("-n", self.ns["redis"], "addr", "add", f"{far}/30", "dev", a)
                _ip("-n", self.ns[side], "addr", "add", f"{near}/30", "dev", b)
                _ip("-n", self.ns["redis"], "link", "set", a, "up")
                _ip("-n", self.ns[side], "link", "set", b, "up")
            for ns in self.ns.values():
                _ip("-n", ns, "link", "set", "lo", "up")
            self.mode = "network namespaces over veth pairs"
        except (OSError, subprocess.SubprocessError) as e:
            self.close()
            self.ns = None
            self.mode = f"separate processes over the loopback (no network namespaces here: {str(e)[:120]})"
            warnings.warn(f"tests/test_vllm_hosts.py: {self.mode}")

    def redis(self) -> RedisServer:
        if self.ns is None:
            return RedisServer(maxmemory="256mb", port=free_port()).start()
        bind = " ".join(far for far, _ in self.addr.values())
        return RedisServer(maxmemory="256mb", port=6390, bind=bind, netns=self.ns["redis"]).start()

    def url(self, side: str, server: RedisServer) -> str:
        host = "127.0.0.1" if self.ns is None else self.addr[side][0]
        return f"redis://{host}:{server.port}/0"

    def command(self, side: str) -> list[str]:
        return [] if self.ns is None else ["ip", "netns", "exec", self.ns[side]]

    def close(self) -> None:
        for ns in (self.ns or {}).values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class Engine:
    """An engine process of tests/vllm_host.py: commands in on stdin, results out through a file."""

    def __init__(self, hosts: Hosts, side: str, model: Path, url: str, tmp: Path, maps: dict[str, Path]):
        self.results, self.log, self.seen = tmp / f"{side}.jsonl", tmp / f"{side}.log", 0
        cmd = [*hosts.command(side), sys.executable, "-m", "tests.vllm_host", "--model", str(model), "--store", url,
               "--results", str(self.results), "--block-size", str(BS),
               *[x for peer, path in maps.items() for x in ("--map", f"{peer}={path}")]]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if hosts.ns is not None:
            env["VLLM_HOST_IP"] = hosts.addr[side][1]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, text=True,
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def ask(self, timeout: float = 400, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.results.read_text().splitlines() if self.results.exists() else []
            if len(lines) > self.seen:
                self.seen += 1
                return json.loads(lines[self.seen - 1])
            if self.proc.poll() is not None:
                raise AssertionError(f"the engine exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no answer in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)


def test_two_engines_sharing_only_redis_hand_off(vpair, tmp_path, record_property):  # noqa: F811
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.adapters.vllm.rowstore.store_open import open_store

    hosts = Hosts()
    record_property("hosts", hosts.mode)
    print(f"two hosts: {hosts.mode}", file=sys.stderr)
    server = engines = None
    try:
        server = hosts.redis()
        harness = open_store(server.unix_url)  # the unix socket: this process, never the engines
        prompt = vpair.prompts[0]
        src = Engine(hosts, "src", vpair.root / "src", hosts.url("src", server), tmp_path, {})
        engines = [src]
        answered = src.ask(op="run", name="turn1", prompt=prompt, salt="s-conv", params={"scope": "conv"})
        assert answered["info"]["captured"] == len(prompt) + len(answered["tokens"]) - 1
        assert src.ask(op="wait_rows", name="filed", scope="conv", tokens=prompt)["found"]
        src.close()  # the source host is gone: only Redis holds its rows
        assert harness.lookup(model_identity(vpair.root / "src"), "conv", prompt).length >= len(prompt)

        tgt = Engine(hosts, "tgt", vpair.root / "tgt", hosts.url("tgt", server), tmp_path,
                     {"src": vpair.root / "src-tgt.map"})
        engines.append(tgt)
        alone = tgt.ask(op="run", name="alone", prompt=prompt, salt=None, params=None)
        record = uuid.uuid4().hex
        handed = tgt.ask(op="run", name="rho1", prompt=prompt, salt=f"h-{uuid.uuid4().hex}",
                         params={"scope": "conv", "rho": 1.0, "record": record})
        n = (len(prompt) - 1) // BS * BS
        assert handed["info"]["status"] == "claimed" and handed["info"]["handoff"]["tokens"] == n
        assert handed["info"]["handoff"]["recomputed"] == n and handed["cached"] == n
        assert handed["tokens"] == alone["tokens"]  # ρ = 1: the target alone's greedy answer
        rec = harness.take_record(record)  # the worker's account, filed in Redis from the target's host
        assert rec["status"] == "handed_off" and rec["tokens"] == n
        assert rec["bytes_read"] == 2 * 2 * 1 * n * 64 * 4  # k and v, 2 layers, 1 KV head, head_dim 64, fp32

        # the entry evicted (its prefix index left): the target prefills the prompt itself and says why
        for key in harness.client.scan_iter(match="rc2:e:*"):
            harness.client.delete(key)
        gone = tgt.ask(op="run", name="evicted", prompt=prompt, salt=f"h-{uuid.uuid4().hex}",
                       params={"scope": "conv", "rho": 1.0})
        assert (gone["info"]["status"], gone["info"]["fallback"]) == ("fallback_reprefill", "evicted")
        assert "handoff" not in gone["info"] and gone["cached"] == 0 and gone["tokens"] == alone["tokens"]

        server.stop()  # Redis down: the same, with its reason, and the engine keeps serving
        down = tgt.ask(op="run", name="down", prompt=prompt, salt=f"h-{uuid.uuid4().hex}",
                       params={"scope": "conv", "rho": 1.0})
        assert (down["info"]["status"], down["info"]["fallback"]) == ("fallback_reprefill", "store_down")
        assert down["cached"] == 0 and down["tokens"] == alone["tokens"]
        again = tgt.ask(op="run", name="after", prompt=prompt, salt=None, params=None)
        assert again["tokens"] == alone["tokens"]
    finally:
        for engine in engines or []:
            engine.close()
        if server is not None:
            server.close()
        hosts.close()
