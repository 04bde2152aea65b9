"""HTTP front of the chat service: an OpenAI-compatible subset, validated at the door.

`POST /v1/chat/completions` takes the usual body (model, messages, max_tokens,
temperature, top_p, seed, stop, stream, and vLLM's cache_salt) and answers in the
usual shape, with one extra object, `rarecache`, saying where the prompt's rows came
from (kept, handed off from which model, how many positions were recomputed), what each
phase cost, and the handoff's outcome for a router (serve/outcome.py: `handoff` applied,
fallback_reprefill with its `fallback_reason`, or unsupported; `approximate_rows_reused`),
which the response also gives in its `x-rarecache-handoff` header. A streamed answer
(server-sent events) carries the object in its last chunk; its headers wait for the
outcome when the service reports it before the first token (ChatService does; the vLLM
service knows it only at the end, and its streams carry no such header). The same outcome goes out
under vLLM semantic-router's header names too (`x-vsr-kv-transfer-status`; `x-vsr-kv-mapper-id` for
the map of an applied handoff), and a request's `x-vsr-kv-mapper-id` header names the only map its
prompt may be handed off through (serve/outcome.py). The front serves any engine through the
`ChatBackend` contract (serve/contract.py) and asks it nothing else. `GET /metrics` is Prometheus
text (serve/metrics.py). Anything
the service does not do (n > 1, tools, penalties, logprobs, top_logprobs) is refused
with a 400 rather than silently ignored.

A request may carry its own handoff budget in a `rarecache` object, used if its prompt is handed
off: `{"rho": 0.2}` (a share in [0, 1]; 1 recomputes every handed-off position, 0 is plain
transfer), `{"rho": "auto"}` (the quality gate, on a server started with `--rho auto`), and
`"selector"` (any selector but the oracles; the vLLM engine runs its own). A ρ alone keeps the
server's selector (the gate policy's on a gated server); a selector alone keeps the server's ρ
(a gated server needs a ρ with it). `rarecache serve --no-request-budget` refuses any budget but
the server's own. The response's `rarecache.rho` and `selector` say what a handoff used.

Scoring a given answer takes vLLM's extensions: `continue_final_message: true` (the last
message is the assistant's and is continued: no generation prompt is added after it;
`add_generation_prompt`, if sent, must then be false) with `prompt_logprobs: 0` (the
logprob of each prompt token) and `max_tokens: 0` (read the message, answer nothing).
The response then has vLLM's top-level `prompt_logprobs`, one entry per prompt token:
`{"<token id>": {"logprob": float, "rank": int, "decoded_token": str}}`, and
`rarecache.final_message_tokens` says how many tokens the final message has (the last
entries). The final message's rows stay held, so the next turn, on either model, keeps or
hands off from them; `rarecache` says how the rows of the prompt before that message were
obtained, as for any request. This is `Conversation.score` over HTTP: the bits per byte of
an answer are -sum(logprob) / (ln 2 * its UTF-8 bytes). Where it differs from vLLM:
  - only the final message's tokens are scored; the entries before them are null (vLLM
    scores every prompt token but the first): the rows before it are reused or handed off,
    not recomputed, so there are no logits for them;
  - the prompt is the messages before the final one rendered with the generation prompt,
    then the final message's text tokenised on its own (the sequence `Conversation.score`
    reads), where vLLM tokenises the template's rendering of the whole conversation cut
    after the final message's stripped text: the same text for ChatML-style templates, but
    the tokens at the seam, and trailing whitespace of the message, may differ;
  - only `prompt_logprobs: 0` (no alternatives; vLLM's k > 0 and -1 are refused), never with
    `stream` (vLLM refuses only k > 0 and -1 there), and only with `continue_final_message`;
  - `max_tokens: 0` is accepted, only with `prompt_logprobs` (vLLM needs 1 or more; with
    1 or more here the answer continues the message, as in vLLM, after the scoring);
  - a final message with no tokens is refused.
`continue_final_message` alone (no `prompt_logprobs`) continues the message, streamed or
not, as vLLM does. An engine that cannot read a final message (`--engine vllm`) refuses it.

The body is JSON (another Content-Type gets a 415) and as strict as OpenAI's: no
coercion (`"2"`, `2.0` or `true` is not an integer, `"yes"` is not a boolean; an integer
is a number), no NaN or Infinity, no lone surrogate in any string (`request.check_text`,
the one rule for every field). Every error, whatever raised it (validation, malformed
JSON or UTF-8, an unknown path, a missing API key), uses OpenAI's `{"error": {...}}`
body. With an API key, every route but `/health` needs `Authorization: Bearer KEY` (the
scheme in any case, the key compared in constant time); `/health` stays open for load
balancers and shows no conversation. FastAPI's /docs, /redoc and /openapi.json are off
unless `openapi_docs` (`serve --openapi-docs`) turns them on.

Every check runs before a stream starts. A client that disconnects mid-stream ends
its decoding at the next token, so it does not hold the models.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from functools import partial
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..engine.generate import SamplingConfig
from ..errors import RarecacheError
from . import outcome
from .guards import MAX_BODY, BearerAuth, BodyLimit, error, is_json, not_json, why_unparsed
from .contract import ChatBackend
from .job import Reply
from .metrics import CONTENT_TYPE, Metrics
from .request import ModelNotFound, check_mapper_id, check_text
from .schema import UNSUPPORTED, ChatRequest, HandoffOptions, asked

LOGPROB_FLOOR = -9999.0  # what vLLM sends for a logprob of -inf (JSON has no infinity)


def _usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(reply.tokens),
            "total_tokens": reply.prompt_tokens + len(reply.tokens)}


def _info(service: ChatBackend, reply: Reply) -> dict:
    """The response's `rarecache` object: where the prompt's rows came from and the handoff's outcome, in
    the fields every engine gives, then what the engine adds in its own words (`describe`)."""
    gate = reply.gate
    info = {"engine": service.engine, "reused_tokens": reply.reused,
            "reused_approximate_tokens": reply.reused_approximate, "handed_off_from": reply.handed_off_from,
            "handed_off_tokens": reply.handed_off, "recomputed_tokens": reply.recomputed,
            "rho": reply.rho, "selector": reply.selector, **outcome.outcome(reply),
            "seconds": {k: round(v, 6) for k, v in reply.seconds.items()}, **service.describe(reply)}
    if gate is not None:  # what the quality gate decided and why; a fallback's rows are the model's own
        info["gate"] = gate
    if service.cfg.budget.gate is not None:  # a gated server: one line on every response
        info["gate_summary"] = gate["summary"] if gate is not None else "the gate did not run: " + (
            "the request named a fixed budget" if reply.handed_off_from is not None
            else "no other model's rows were handed off (the model read the prompt itself)")
    if reply.continued:  # continue_final_message: the last prompt tokens, read by the model itself
        info["final_message_tokens"] = reply.continued
    return info


def _budget_info(service: ChatBackend) -> dict:
    """The server's own handoff budget, as /health shows it (a client checks what it can ask for)."""
    cfg = service.cfg
    return {**cfg.budget.describe(), "request_budget": cfg.request_budget,
            "min_handoff_tokens": cfg.min_handoff_tokens}


def _prompt_logprobs(reply: Reply) -> list[dict | None]:
    """vLLM's `prompt_logprobs` (prompt_logprobs 0): per prompt token, null, or for the final message's
    tokens {token id: {logprob, rank, decoded_token}}."""
    scored = [{str(t): dict(logprob=LOGPROB_FLOOR if lp == float("-inf") else lp, rank=rank, decoded_token=text)}
              for t, lp, rank, text in reply.prompt_logprobs or ()]
    return [None] * (reply.prompt_tokens - len(scored)) + scored


class _Run:
    """A streamed answer's work, started before its response so that the response's headers can carry
    the handoff's outcome (a service with `streams_outcome` reports it before the first token)."""

    def __init__(self, call: Callable[..., Reply], with_start: bool):
        self.loop, self.queue, self.gone = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        self.first: tuple[str, object] | None = None  # an event read early (start) or to give back (not start)
        kw = {"on_text": lambda piece: self.put("text", piece), "cancelled": self.gone.is_set}
        if with_start:
            kw["on_start"] = lambda fields: self.put("start", fields)
        self.task = self.loop.run_in_executor(None, self.work, call, kw)

    def put(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))

    def work(self, call, kw) -> None:
        try:
            self.put("done", call(**kw))
        except Exception as e:  # noqa: BLE001  (reported to the client, which is already streaming)
            self.put("error", e)

    async def headers(self) -> dict[str, str]:
        """The outcome's header, once the service gave it (or what came instead, kept for `next`)."""
        self.first = await self.queue.get()
        kind, value = self.first
        if kind != "start":
            return {}
        self.first = None
        return outcome.headers(value)

    async def next(self) -> tuple[str, object]:
        if self.first is not None:
            event, self.first = self.first, None
            return event
        return await self.queue.get()


async def _stream(service: ChatBackend, head: dict, run: _Run, req: ChatRequest,
                  metrics: Metrics) -> AsyncIterator[str]:
    """Server-sent events: a role chunk, a chunk per piece of text as it is decoded, a last chunk
    with the finish reason (and `rarecache`), a usage chunk if asked, then [DONE]."""

    def event(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return event({**head, "object": "chat.completion.chunk",
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})

    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            kind, value = await run.next()
            if kind == "text":
                yield chunk({"content": value})
                continue
            if kind == "start":  # (a service that reports it when the headers were not waiting for it)
                continue
            if kind == "error":
                yield event({"error": {"message": str(value), "type": "server_error"}})
            else:
                info = _info(service, value)
                metrics.observe(value.model, info, value.seconds)
                yield chunk({}, value.finish_reason, rarecache=info)
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield event({**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(value)})
            break
        yield "data: [DONE]\n\n"
    finally:
        run.gone.set()  # a client that went away stops the decoding at its next token
        await asyncio.shield(run.task)


def create_app(service: ChatBackend, default_max_tokens: int = 256, max_body: int = MAX_BODY,
               max_waiting: int = 16, api_key: str | None = None, openapi_docs: bool = False) -> FastAPI:
    """The HTTP app over `service`. Past the service's `max_batch` running answers and
    `max_waiting` queued requests, a new request gets a 503 with Retry-After instead of a place in line.
    With `api_key`, every route but /health needs it as a bearer token. `openapi_docs`: serve FastAPI's
    /docs, /redoc and /openapi.json (off by default: no document lists them, and they describe the API
    to anyone who can reach the port)."""
    in_flight = [0]  # touched only on the event loop
    metrics = Metrics(service)

    def release(flag: list[bool]) -> None:
        if not flag[0]:
            flag[0] = True
            in_flight[0] -= 1

    docs = {} if openapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="rarecache", summary="chat completions with cross-model KV-cache handoff", **docs)
    app.state.service, app.state.metrics = service, metrics
    app.add_middleware(BodyLimit, limit=max_body)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)  # added last: runs first, before the body is read

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        if not is_json(request.headers.get("content-type")):  # the framework left the body unparsed
            return not_json(request.headers.get("content-type"))
        try:  # a lone surrogate the schema refused in its own words: the one rule's
            check_text(exc.body, "")
        except RarecacheError as e:
            return error(400, str(e))
        parts = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'malformed')})")
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(HTTPException)  # unknown paths, wrong methods, a body the framework cannot parse
    async def _http(request: Request, exc: HTTPException):
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = why_unparsed(exc.__cause__)
        return error(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)  # a bug of ours: still the one error shape (and still logged)
    async def _bug(request: Request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}")

    @app.get("/health")
    def health():
        running, waiting = service.load
        return {"status": "ok", "models": list(service.models), "requests_in_flight": in_flight[0],
                "answers_running": running, "requests_waiting": waiting, "max_batch": service.cfg.max_batch,
                "held_cache_bytes": service.held_bytes(), "handoff": _budget_info(service),
                "heal": service.healing, "healed_positions": service.healed}

    @app.get("/metrics")
    def scrape():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "rarecache",
             "handoff_from": [a for (a, b) in service.maps if b == name]} for name in service.models]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        extra = req.model_extra or {}
        try:
            check_text({**req.model_dump(exclude_none=True), **extra}, "")  # every string, the one rule
        except RarecacheError as e:
            return error(400, str(e))
        refused = [k for k in UNSUPPORTED if asked(k, extra.get(k))]
        if refused:
            return error(400, f"not supported by this server: {', '.join(refused)}")
        if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
            return error(400, "max_tokens and max_completion_tokens disagree")
        wrong = req.refusal()
        if wrong is not None:
            return error(400, wrong)
        try:
            opts = req.rarecache or HandoffOptions()
            mapper = check_mapper_id(request.headers.get(outcome.ROUTER_MAPPER))
            budget = {"rho": opts.rho, "selector": opts.selector}
            new = req.answer_tokens(default_max_tokens)
            sampling = None if new == 0 else SamplingConfig(max_new_tokens=new, temperature=req.temperature,
                                                            top_p=req.top_p, seed=req.seed)
            messages = [m.model_dump() for m in req.messages]
            if req.continue_final_message:  # tokenised, checked; the final message read after the rest
                prompt = service.prepare_continued(req.model, messages, sampling, req.stops(), req.cache_salt)
                call = partial(service.continue_final, req.model, prompt, sampling, req.stops(), salt=req.cache_salt,
                               logprobs=req.prompt_logprobs is not None, mapper=mapper, **budget)
            else:
                ids = service.prepare(req.model, messages, sampling, req.stops(), req.cache_salt)  # tokenised, checked
                call = partial(service.answer, req.model, ids, sampling, req.stops(), salt=req.cache_salt,
                               mapper=mapper, **budget)
            service.check_budget(**budget)  # (answer checks it again; a stream must fail here, before it starts)
        except ModelNotFound as e:
            return error(404, str(e), code="model_not_found")
        except (RarecacheError, ValueError) as e:
            return error(400, str(e))
        if in_flight[0] >= service.cfg.max_batch + max_waiting:
            busy = error(503, f"the server is busy ({in_flight[0]} requests ahead); retry later", kind="server_busy")
            busy.headers["Retry-After"] = "1"
            return busy
        in_flight[0] += 1
        done = [False]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
        if req.stream:  # released once the stream ends, however it ends
            early = service.streams_outcome  # the outcome comes before the first token
            run = _Run(call, early)
            try:
                headers = await run.headers() if early else {}
            except BaseException:  # (cancelled while waiting: the work stops at its next token)
                run.gone.set()
                release(done)
                raise
            return StreamingResponse(_stream(service, head, run, req, metrics), media_type="text/event-stream",
                                     headers=headers, background=BackgroundTask(release, done))
        try:
            reply = await run_in_threadpool(call)
        except RarecacheError as e:
            return error(400, str(e))
        finally:
            release(done)
        info = _info(service, reply)
        metrics.observe(reply.model, info, reply.seconds)
        body = {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text},
                             "finish_reason": reply.finish_reason}],
                "usage": _usage(reply), "rarecache": info}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = _prompt_logprobs(reply)
        return JSONResponse(body, headers=outcome.headers(info))

    return app
