"""`rarecache bench soak`: the real server under twice the load it can take, then killed and restarted.

A timed test would be flaky on a shared CPU, so this is a benchmark whose checks are counts.
It starts `rarecache serve` as a subprocess bound to 127.0.0.1 on a free port, measures the rate
at which it answers when kept full (closed loop: `max_batch` clients back to back, briefly), then
offers requests open loop at `overload` times that rate for `duration_s` seconds (at most
`max_requests`), each asking for a small answer. Every accepted request must come back whole (a
200 with a finish reason) and every refusal must be a 503 with Retry-After; anything else is a
failure. The server's resident memory is sampled throughout, so a leak shows as a slope. Then,
with load still arriving, the server is killed with SIGKILL, started again with the same command,
and one request must be answered. Nothing leaves the machine: the server binds the loopback
address and the load goes only there.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import RarecacheError

HOST = "127.0.0.1"


@dataclass(frozen=True)
class SoakConfig:
    serve_args: tuple[str, ...] = ()  # passed to `rarecache serve` (models, map, dtype, limits); host and port are ours
    saturation_s: float = 20.0  # closed-loop measurement of the rate the server sustains
    duration_s: float = 180.0  # open-loop overload
    overload: float = 2.0  # offered rate = overload x the saturation rate
    max_requests: int = 5000  # bound on the overload phase's requests
    max_tokens: int = 8
    kill_after_s: float = 5.0  # load before the SIGKILL
    startup_timeout_s: float = 900.0  # a first start may convert the models (or calibrate a quick map where
    # the shipped one does not fit them)
    request_timeout_s: float = 300.0
    rss_every_s: float = 0.5

    def __post_init__(self):
        if not (self.saturation_s > 0 and self.duration_s > 0 and self.overload > 0 and self.max_requests >= 1
                and self.max_tokens >= 1 and self.kill_after_s >= 0 and self.startup_timeout_s > 0):
            raise RarecacheError("soak needs positive durations, overload and max tokens, and max requests >= 1")
        if any(a in ("--host", "--port") or a.startswith(("--host=", "--port=")) for a in self.serve_args):
            raise RarecacheError("the soak picks the server's host (127.0.0.1) and port itself")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Outcome:
    """One request's fate."""

    status: int | None  # None: no HTTP answer (connection refused or cut)
    seconds: float
    retry_after: str | None = None
    whole: bool = False  # a 200 with a finish reason
    error: str | None = None


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 60.0) -> Outcome:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"content-type": "application/json"} if data else {})
        r = conn.getresponse()
        raw = r.read()
        out = Outcome(r.status, time.perf_counter() - t0, r.getheader("Retry-After"))
        if r.status == 200 and path.endswith("/completions"):
            try:
                out.whole = json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")
            except (ValueError, KeyError, IndexError, TypeError):
                out.whole = False
        return out
    except (OSError, http.client.HTTPException) as e:
        return Outcome(None, time.perf_counter() - t0, error=type(e).__name__)
    finally:
        conn.close()


class Server:
    """`rarecache serve` in a subprocess on the loopback address; its output goes to a log file."""

    def __init__(self, args: tuple[str, ...], port: int, log: Path):
        self.args, self.port, self.log = args, port, log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        """Start it and wait until /health answers; the seconds that took."""
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "rarecache.cli", "serve", *self.args, "--host", HOST, "--port", str(self.port)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RarecacheError(f"rarecache serve exited with {self.proc.returncode} before answering:\n"
                                     + self.tail())
            if request(self.port, "GET", "/health", timeout=5).status == 200:
                return time.perf_counter() - t0
            time.sleep(0.2)
        self.kill()
        raise RarecacheError(f"rarecache serve did not answer /health within {timeout:g} s:\n" + self.tail())

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class RssSampler:
    """Resident memory of one process every `every` seconds, on a thread, until stopped."""

    pid: int
    every: float
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)

    def __post_init__(self):
        try:
            import psutil
        except ImportError:
            raise RarecacheError("bench soak reads memory with psutil: pip install psutil") from None
        self._proc, self._stop, self._t0 = psutil.Process(self.pid), threading.Event(), time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.perf_counter() - self._t0, self._proc.memory_info().rss / 2**20))
            except Exception:  # noqa: BLE001  (the process is gone: the kill phase)
                return
            self._stop.wait(self.every)

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def _body(models: list[str], i: int, max_tokens: int) -> dict:
    return {"model": models[i % len(models)], "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Request {i}: name one prime number."}]}


def saturation(port: int, models: list[str], clients: int, seconds: float, max_tokens: int,
               timeout: float) -> tuple[float, list[Outcome]]:
    """Answers per second with `clients` clients back to back for `seconds` (the server kept full)."""
    outcomes: list[Outcome] = []
    lock, counter, t0 = threading.Lock(), [0], time.perf_counter()

    def client() -> None:
        while time.perf_counter() - t0 < seconds:
            with lock:
                i = counter[0]
                counter[0] += 1
            out = request(port, "POST", "/v1/chat/completions", _body(models, i, max_tokens), timeout)
            with lock:
                outcomes.append(out)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return sum(o.status == 200 for o in outcomes) / wall, outcomes


def open_loop(port: int, models: list[str], rate: float, seconds: float, limit: int, max_tokens: int,
              timeout: float, start: int = 0, stop: threading.Event | None = None) -> tuple[float, list[Outcome]]:
    """Requests at `rate` per second for `seconds` (at most `limit`), each on its own worker whatever the
    server does; the seconds the offering took and every outcome."""
    stop = stop or threading.Event()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=256) as pool:
        futures = []
        for i in range(limit):
            due = i / rate
            if due >= seconds:
                break
            delay = t0 + due - time.perf_counter()
            if (delay > 0 and stop.wait(delay)) or stop.is_set():
                break
            futures.append(pool.submit(request, port, "POST", "/v1/chat/completions",
                                       _body(models, start + i, max_tokens), timeout))
        offered = time.perf_counter() - t0
        outcomes = [f.result() for f in futures]
    return offered, outcomes


def _summary(outcomes: list[Outcome]) -> dict:
    ok = [o for o in outcomes if o.status == 200]
    busy = [o for o in outcomes if o.status == 503]
    lat = sorted(o.seconds for o in ok)
    return {"sent": len(outcomes), "answered": len(ok), "whole": sum(o.whole for o in ok),
            "refused_503": len(busy), "refused_with_retry_after": sum(o.retry_after is not None for o in busy),
            "other_status": sum(o.status not in (200, 503, None) for o in outcomes),
            "no_answer": sum(o.status is None for o in outcomes),
            "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
            "latency_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None}


def run_soak(cfg: SoakConfig, emit=print, log: Path | None = None) -> dict:
    """The whole soak; the result (also what `emit` prints as a table) as a dict with `ok`."""
    log = log or Path(tempfile.mkstemp(prefix="rarecache-soak-", suffix=".log")[1])
    server = Server(cfg.serve_args, free_port(), log)
    emit(f"starting rarecache serve {' '.join(cfg.serve_args)} on {HOST}:{server.port} (log: {log})")
    try:
        startup = server.start(cfg.startup_timeout_s)
        health = json.loads(_get(server.port, "/health"))
        models = [m["id"] for m in json.loads(_get(server.port, "/v1/models"))["data"]]
        rss = RssSampler(server.proc.pid, cfg.rss_every_s)
        sat_rate, sat = saturation(server.port, models, health["max_batch"], cfg.saturation_s, cfg.max_tokens,
                                   cfg.request_timeout_s)
        if sat_rate <= 0:
            raise RarecacheError(f"the server answered nothing in {cfg.saturation_s:g} s of saturation:\n"
                                 + server.tail())
        rate = cfg.overload * sat_rate
        emit(f"saturation: {sat_rate:.2f} answers/s with {health['max_batch']} clients; offering {rate:.2f}/s "
             f"for {cfg.duration_s:g} s (at most {cfg.max_requests} requests)")
        offered_s, load = open_loop(server.port, models, rate, cfg.duration_s, cfg.max_requests, cfg.max_tokens,
                                    cfg.request_timeout_s, start=len(sat))
        samples = rss.stop()
        # the kill: load keeps arriving, the server dies mid-answer, and comes back with the same command
        stop = threading.Event()
        cut: list[Outcome] = []
        loader = threading.Thread(target=lambda: cut.extend(open_loop(
            server.port, models, rate, cfg.kill_after_s + 60, cfg.max_requests, cfg.max_tokens, 30,
            start=len(sat) + len(load), stop=stop)[1]))
        loader.start()
        time.sleep(cfg.kill_after_s)
        server.kill()
        stop.set()
        loader.join()
        restart = server.start(cfg.startup_timeout_s)
        after = request(server.port, "POST", "/v1/chat/completions", _body(models, 0, cfg.max_tokens),
                        cfg.request_timeout_s)
    finally:
        server.kill()
    over = _summary(load)
    mib = [m for _, m in samples]
    result = {
        "bench": "soak", "serve_args": list(cfg.serve_args), "config": asdict(cfg), "models": models,
        "startup_s": round(startup, 2), "saturation_rps": round(sat_rate, 3), "saturation": _summary(sat),
        "offered_rps": round(len(load) / offered_s, 3) if offered_s else 0.0, "overload": over,
        "rss_mib": {"start": round(mib[0], 1), "max": round(max(mib), 1), "end": round(mib[-1], 1),
                    "samples": [(round(t, 1), round(m, 1)) for t, m in samples[:: max(1, len(samples) // 200)]]}
        if mib else None,
        "kill": {"sent_before_kill": len(cut), "answered": sum(o.status == 200 for o in cut),
                 "cut_or_refused_connection": sum(o.status is None for o in cut)},
        "restart_s": round(restart, 2), "after_restart": {"status": after.status, "whole": after.whole},
    }
    failures = []
    if over["whole"] != over["answered"] or over["other_status"] or over["no_answer"]:
        failures.append("an accepted request did not complete, or an answer was neither 200 nor 503")
    if over["refused_with_retry_after"] != over["refused_503"]:
        failures.append("a 503 came without Retry-After")
    if not (after.status == 200 and after.whole):
        failures.append("no answer after the restart")
    result["failures"], result["ok"] = failures, not failures
    _table(result, emit)
    return result


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def _table(r: dict, emit) -> None:
    o, rss = r["overload"], r["rss_mib"] or {}
    rows = [("startup", f"{r['startup_s']:.1f} s"),
            ("saturation", f"{r['saturation_rps']:.2f} answers/s"),
            ("offered", f"{r['offered_rps']:.2f} requests/s ({o['sent']} sent)"),
            ("answered (whole)", f"{o['answered']} ({o['whole']})"),
            ("refused 503 (with Retry-After)", f"{o['refused_503']} ({o['refused_with_retry_after']})"),
            ("other status / no answer", f"{o['other_status']} / {o['no_answer']}"),
            ("latency p50 / p95", f"{o['latency_p50_s']} / {o['latency_p95_s']} s"),
            ("RSS start / max / end", f"{rss.get('start')} / {rss.get('max')} / {rss.get('end')} MiB"),
            ("killed with", f"{r['kill']['sent_before_kill']} requests arriving, "
                            f"{r['kill']['cut_or_refused_connection']} cut"),
            ("restart, then one request", f"{r['restart_s']:.1f} s, HTTP {r['after_restart']['status']}"),
            ("result", "ok" if r["ok"] else "FAILED: " + "; ".join(r["failures"]))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        emit(f"{k:<{width}}  {v}")
