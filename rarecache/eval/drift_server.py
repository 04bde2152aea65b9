"""Drift through a chat server (`rarecache serve`): `run_drift_server` runs eval/drift.py's arms, each
turn a stateless request carrying the conversation so far, its gold answer as a final assistant
message to score (vLLM's `continue_final_message` with `prompt_logprobs: 0`, `max_tokens: 0`;
serve/app.py), its `model` field alternating between the served source and target (source on odd turns),
and the bpb comes from the returned logprobs of the answer's tokens. The server keeps the
scored rows and hands off between its models itself, so this measures the server's path; each
conversation has a `cache_salt` of its own, so arms and stories never share rows. Each request
names its arm's budget in the body's `rarecache` object (`RHO:SELECTOR` as `{"rho": RHO,
"selector": SELECTOR}`, `gate` as `{"rho": "auto"}`, which needs a server started with `--rho
auto`), so one server runs every arm, and every turn is checked to have been handed off (or not)
exactly as `Conversation` would, with that budget. Its rows say `"via": "server"`; a results
file holds rows of one path only.
"""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path
from typing import Any

from ..errors import RarecacheError
from ..transfer.handoff import HandoffConfig
from .drift import heals, parse_arm, run_arms


class DriftServer:
    """The chat server the drift turns go to: `url` (e.g. http://127.0.0.1:8000) through httpx, or
    `client`, any httpx-style client already bound to it (FastAPI's TestClient in the tests).
    `source` and `target` are the served models' names (the requests' `model` field)."""

    def __init__(self, url: str | None = None, source: str = "source", target: str = "target",
                 api_key: str | None = None, client: Any = None, timeout: float = 3600.0, retries: int = 30):
        try:
            import httpx
        except ImportError:
            httpx = None
        if client is None:
            if not url:
                raise RarecacheError("give the server's URL")
            if httpx is None:
                raise RarecacheError("--server needs httpx: pip install httpx")
            client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout)
        self.client, self.url, self.retries = client, url, retries
        self._unreachable = (httpx.TransportError,) if httpx is not None else ()
        self.names = {"source": source, "target": target}
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._maps: set[tuple[str, str]] | None = None

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        for attempt in range(self.retries + 1):
            try:
                r = self.client.request(method, path, json=body, headers=self.headers)
            except self._unreachable as e:  # the server is not there, or it dropped the connection
                raise RarecacheError(f"the server at {self.url} did not answer: {e}") from None
            if r.status_code == 503 and attempt < self.retries:  # busy: as its Retry-After says
                time.sleep(float(r.headers.get("retry-after", 1)))
                continue
            try:
                data = r.json()
            except ValueError:
                data = None
            if r.status_code != 200:
                msg = data["error"]["message"] if isinstance(data, dict) and "error" in data else r.text[:300]
                raise RarecacheError(f"the server refused {method} {path} ({r.status_code}): {msg}")
            return data
        raise AssertionError("unreachable")

    def maps(self) -> set[tuple[str, str]]:
        """The (from, to) role pairs the server hands off between, read once from GET /v1/models."""
        if self._maps is None:
            served = {m["id"]: m.get("handoff_from") or [] for m in self._call("GET", "/v1/models")["data"]}
            for role, name in self.names.items():
                if name not in served:
                    raise RarecacheError(f"the server has no model {name!r} (--{role}); it serves "
                                         f"{', '.join(served) or 'none'}")
            self._maps = {(a, b) for a in self.names for b in self.names
                          if a != b and self.names[a] in served[self.names[b]]}
        return self._maps

    def budget(self) -> dict:
        """The server's own handoff budget (GET /health's `handoff`; empty from a server that shows none)."""
        return self._call("GET", "/health").get("handoff") or {}

    def score(self, who: str, messages: list[dict[str, str]], answer: str, salt: str,
              budget: dict | None = None) -> dict:
        """The response to scoring `answer` as the final assistant message after `messages`, with `who`'s
        model (and the handoff budget `budget`, the request's `rarecache` object, if given)."""
        return self._call("POST", "/v1/chat/completions", {
            "model": self.names[who], "messages": [*messages, {"role": "assistant", "content": answer}],
            "continue_final_message": True, "add_generation_prompt": False, "prompt_logprobs": 0, "max_tokens": 0,
            "cache_salt": salt, **({"rarecache": budget} if budget else {})})


class _Served:
    """One conversation through the server, with a cache salt of its own: each turn's row fields.
    Every turn is checked to have been handed off exactly when `Conversation` would hand it off
    (the other model spoke last and the server has a map from it), with the arm's budget."""

    def __init__(self, server: DriftServer, arm: str, cfg: HandoffConfig | None):
        self.server, self.arm, self.cfg = server, arm, cfg
        self.salt = f"rarecache-drift-{uuid.uuid4().hex}"
        # the request's own budget: the arm's (alone hands nothing off)
        self.budget = (None if arm == "alone" else {"rho": "auto"} if cfg is None
                       else {"rho": cfg.rho, "selector": cfg.name})
        self.messages: list[dict[str, str]] = []
        self.last: str | None = None

    def score(self, user: str, answer: str, who: str) -> dict:
        messages = [*self.messages, {"role": "user", "content": user}]
        t0 = time.perf_counter()
        body = self.server.score(who, messages, answer, self.salt, self.budget)
        wall = time.perf_counter() - t0
        info = body.get("rarecache") or {}
        n = info.get("final_message_tokens")
        scored = (body.get("prompt_logprobs") or [])[-n:] if n else []
        if not n or len(scored) != n or any(not isinstance(e, dict) or len(e) != 1 for e in scored):
            raise RarecacheError("the server's response has no prompt_logprobs for the answer's tokens "
                                 "(is it rarecache serve with our own engine?)")
        lp = sum(next(iter(e.values()))["logprob"] for e in scored)
        self._check(info, who)
        row = {"model": who, "served_model": self.server.names[who], "via": "server",
               "bpb": -lp / (math.log(2) * len(answer.encode("utf-8"))),
               "prompt_tokens": body["usage"]["prompt_tokens"] - n, "reused": info["reused_tokens"],
               "seconds": {**info.get("seconds", {}), "request": wall}}
        if info["handed_off_from"] is not None:
            row.update(handed_off=info["handed_off_tokens"], recomputed=info["recomputed_tokens"])
        if info.get("gate") is not None:
            row["gate"] = info["gate"]
        self.messages = [*messages, {"role": "assistant", "content": answer}]
        self.last = who
        return row

    def _check(self, info: dict, who: str) -> None:
        expected = self.last is not None and self.last != who and (self.last, who) in self.server.maps()
        source = info.get("handed_off_from")
        if (source is not None) != expected or (expected and source != self.server.names[self.last]):
            raise RarecacheError(
                f"{self.arm}: the server {'handed off from ' + str(source) if source else 'did not hand off'} "
                f"where Conversation {'hands off from ' + self.server.names[self.last] if expected else 'does not'} "
                "(another client's requests, or a cache budget too small for one conversation: --cache-gib?)")
        if source is None or self.cfg is None and info.get("gate") is not None:
            return
        if self.cfg is None:
            raise RarecacheError(f"{self.arm}: the server handed off at a fixed rho {info.get('rho')} "
                                 f"({info.get('selector')}), not through the gate it was asked for (a server that "
                                 "ignores the request's rarecache object?)")
        if info.get("gate") is not None or info.get("rho") != self.cfg.rho or info.get("selector") != self.cfg.name:
            how = ("through the gate" if info.get("gate") is not None
                   else f"at rho {info.get('rho')} ({info.get('selector')})")
            raise RarecacheError(f"{self.arm}: the server handed off {how}, not at rho {self.cfg.rho:g} "
                                 f"({self.cfg.name}) as asked (a server that ignores the request's rarecache object?)")


def run_drift_server(convs, server: DriftServer, arms: list[str], out: Path, progress: bool = True) -> Path:
    """`run_drift` through a chat server: the same stories, turns and arms, each turn a request
    (module docstring). Each request names its arm's budget, checked at every handoff."""
    parsed = [parse_arm(a) for a in arms]
    if any(name != "alone" for name, _ in parsed) and ("source", "target") not in server.maps():
        raise RarecacheError(f"the server has no map from {server.names['source']} to {server.names['target']}: "
                             "a switching arm has nothing to hand off")
    own = server.budget()
    for name, cfg in parsed:  # what the server would refuse, before any row is written
        if heals(name):
            raise RarecacheError(f"{name}: healing runs in process only (`eval drift run` without --server); a "
                                 "server does not heal held rows")
        if cfg is not None and cfg.scorer is not None and cfg.scorer.oracle:
            raise RarecacheError(f"{name}: {cfg.name} is an oracle; a server does not hand off with it")
        if name == "switch/gate" and not own.get("gate"):
            raise RarecacheError("the gate arm needs a server started with --rho auto --gate-policy FILE")
        if name not in ("alone", "switch/gate") and not own.get("request_budget", True) and (
                own.get("gate") or (own.get("rho"), own.get("selector")) != (cfg.rho, cfg.name)):
            raise RarecacheError(f"{name}: the server takes no request's budget (--no-request-budget) and hands "
                                 f"off with its own ({'the gate' if own.get('gate') else own.get('rho')})")
    return run_arms(convs, parsed, out, progress, "server", lambda arm, cfg: _Served(server, arm, cfg),
                lambda who: _Served(server, "alone", None))
