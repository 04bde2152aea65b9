"""HTTP front of the chat service: an OpenAI-compatible subset, validated at the door.

`POST /v1/chat/completions` takes the usual body (model, messages, max_tokens,
temperature, top_p, seed, stop, stream, and vLLM's cache_salt) and answers in the
usual shape, with one extra object, `rarecache`, saying where the prompt's rows came
from (kept, handed off from which model, how many positions were recomputed) and
what each phase cost. A streamed answer (server-sent events) carries it in its last
chunk. Anything the service does not do (n > 1, tools, penalties, logprobs,
top_logprobs) is refused with a 400 rather than silently ignored.

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

The body is as strict as OpenAI's: no coercion (`"2"`, `2.0` or `true` is not an
integer, `"yes"` is not a boolean; an integer is a number), no NaN or Infinity. Every
error, whatever raised it (validation, malformed JSON or UTF-8, an unknown path, a
missing API key), uses OpenAI's `{"error": {...}}` body. With an API key, every
route but `/health` needs `Authorization: Bearer KEY` (compared in constant time);
`/health` stays open for load balancers and shows no conversation.

Every check runs before a stream starts. A client that disconnects mid-stream ends
its decoding at the next token, so it does not hold the models.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from functools import partial
from typing import AsyncIterator, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..engine.generate import SamplingConfig
from ..errors import RarecacheError
from .service import MAX_SALT, ChatService, ModelNotFound, Reply, Role

LOGPROB_FLOOR = -9999.0  # what vLLM sends for a logprob of -inf (JSON has no infinity)

UNSUPPORTED = ("n", "tools", "tool_choice", "functions", "function_call", "logprobs",
               "top_logprobs", "response_format", "frequency_penalty", "presence_penalty", "logit_bias")


def _asked(key: str, value) -> bool:
    """Whether an unsupported field asks for something other than the default behaviour."""
    if key == "n":
        return value is not None and not (type(value) is int and value == 1)
    return value is not None and value is not False and value not in (0, "", [], {})


STRICT = ConfigDict(strict=True, allow_inf_nan=False)  # as OpenAI: no coercion (an int is a float), no NaN


class Message(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")
    role: Role
    content: str = Field(max_length=1_000_000)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class HandoffOptions(BaseModel):
    """The request's `rarecache` object: its own handoff budget instead of the server's."""

    model_config = ConfigDict(**STRICT, extra="forbid")
    rho: float | Literal["auto"] | None = None  # a share in [0, 1] (checked by the service), or the gate
    selector: str | None = Field(None, max_length=64)


class ChatRequest(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")  # unsupported OpenAI fields are named in the error
    model: str = Field(max_length=256)
    messages: list[Message] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=0)  # 0: only with prompt_logprobs (checked in `chat`)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(0.0, ge=0, le=2)  # greedy unless asked: handoff results are comparable
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT)  # caches are shared within one salt
    # vLLM's extensions for scoring a given final assistant message (module docstring)
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None  # vLLM's default, true, unless continue_final_message
    prompt_logprobs: int | None = None
    rarecache: HandoffOptions | None = None  # this request's handoff budget (module docstring)

    def answer_tokens(self, default: int) -> int:
        for n in (self.max_completion_tokens, self.max_tokens):
            if n is not None:
                return n
        return default

    def refusal(self) -> str | None:
        """What is wrong with the combination of the scoring fields, if anything."""
        asked_zero = 0 in (self.max_tokens, self.max_completion_tokens)
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs < -1:
                return "prompt_logprobs must be 0 or more"
            if self.prompt_logprobs != 0:
                return "not supported by this server: prompt_logprobs other than 0 (alternatives to each prompt token)"
            if self.stream:
                return "prompt_logprobs are not available with stream"
            if not self.continue_final_message:
                return ("prompt_logprobs needs continue_final_message: this server scores the final assistant "
                        "message of a conversation")
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message and add_generation_prompt cannot both be true"
        if self.add_generation_prompt is False and not self.continue_final_message:
            return "not supported by this server: add_generation_prompt false without continue_final_message"
        if asked_zero and self.prompt_logprobs is None:
            return "max_tokens 0 (no answer) is accepted only with continue_final_message and prompt_logprobs"
        return None

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def _error(status: int, message: str, kind: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status, headers=headers)


class BearerAuth:
    """ASGI middleware: every path but /health needs `Authorization: Bearer <key>` (as vLLM's --api-key),
    else a 401 before the body is read. The key is compared in constant time."""

    OPEN = ("/health",)

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                denied = _error(401, "Incorrect or missing API key: send the header Authorization: Bearer KEY",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await denied(scope, receive, send)
        return await self.app(scope, receive, send)


MAX_BODY = 8 << 20  # bytes; far above what max_prompt_chars lets through


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 before it is read into memory,
    whether it declares its length or arrives in chunks."""

    def __init__(self, app, limit: int = MAX_BODY):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = _error(413, f"the request body exceeds {self.limit} bytes")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await too_big(scope, receive, send)
        seen, over, answered = 0, False, False

        async def counted():
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                over = True
                raise _TooBig  # the framework may turn this into its own error response: replaced below
            return message

        async def guarded(message):
            nonlocal answered
            if not over:
                return await send(message)
            if not answered:
                answered = True
                await too_big(scope, receive, send)

        try:
            await self.app(scope, counted, guarded)
        except _TooBig:
            if not answered:
                await too_big(scope, receive, send)


class _TooBig(Exception):
    pass


def _why_unparsed(cause: BaseException | None) -> str:
    """Why the framework could not parse a body (its own message only says that it could not)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8 ({cause.reason} at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "the body is not valid JSON (nested too deeply)"
    return f"the body is not valid JSON ({cause})" if cause is not None else "the body could not be parsed"


def _usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(reply.tokens),
            "total_tokens": reply.prompt_tokens + len(reply.tokens)}


def _info(service: ChatService, reply: Reply) -> dict:
    if hasattr(service, "describe"):  # another engine's service says what it did (adapters/vllm/serving.py)
        return service.describe(reply)
    gate = reply.gate
    info = {"reused_tokens": reply.reused, "reused_approximate_tokens": reply.reused_approximate,
            "handed_off_from": reply.handed_off_from,
            "handed_off_tokens": reply.handed_off, "recomputed_tokens": reply.recomputed,
            "rho": reply.rho, "selector": reply.selector,
            "seconds": {k: round(v, 6) for k, v in reply.seconds.items()}}
    if gate is not None:  # what the quality gate decided and why; a fallback's rows are the model's own
        info["gate"] = gate
    if reply.continued:  # continue_final_message: the last prompt tokens, read by the model itself
        info["final_message_tokens"] = reply.continued
    return info


def _budget_info(service) -> dict:
    """The server's own handoff budget, as /health shows it (a client checks what it can ask for)."""
    cfg = service.cfg
    if hasattr(cfg, "budget"):  # ChatService
        b = cfg.budget
        return {"rho": None if b.gate else b.handoff.rho, "selector": b.selector, "gate": b.gate is not None,
                "request_budget": cfg.request_budget}
    return {"rho": cfg.rho, "selector": cfg.selector, "gate": False, "request_budget": cfg.request_budget}


def _prompt_logprobs(reply: Reply) -> list[dict | None]:
    """vLLM's `prompt_logprobs` (prompt_logprobs 0): per prompt token, null, or for the final message's
    tokens {token id: {logprob, rank, decoded_token}}."""
    scored = [{str(t): {"logprob": LOGPROB_FLOOR if lp == float("-inf") else lp, "rank": rank, "decoded_token": text}}
              for t, lp, rank, text in reply.prompt_logprobs or ()]
    return [None] * (reply.prompt_tokens - len(scored)) + scored


async def _stream(service: ChatService, head: dict, call: Callable[..., Reply], req: ChatRequest) -> AsyncIterator[str]:
    """Server-sent events: a role chunk, a chunk per piece of text as it is decoded, a last chunk
    with the finish reason (and `rarecache`), a usage chunk if asked, then [DONE]."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    gone = threading.Event()

    def work() -> None:
        try:
            reply = call(on_text=lambda piece: loop.call_soon_threadsafe(queue.put_nowait, ("text", piece)),
                         cancelled=gone.is_set)
            loop.call_soon_threadsafe(queue.put_nowait, ("done", reply))
        except Exception as e:  # noqa: BLE001  (reported to the client, which is already streaming)
            loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

    def event(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return event({**head, "object": "chat.completion.chunk",
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})

    task = loop.run_in_executor(None, work)
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            kind, value = await queue.get()
            if kind == "text":
                yield chunk({"content": value})
                continue
            if kind == "error":
                yield event({"error": {"message": str(value), "type": "server_error"}})
            else:
                yield chunk({}, value.finish_reason, rarecache=_info(service, value))
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield event({**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(value)})
            break
        yield "data: [DONE]\n\n"
    finally:
        gone.set()  # a client that went away stops the decoding at its next token
        await asyncio.shield(task)


def create_app(service: ChatService, default_max_tokens: int = 256, max_body: int = MAX_BODY,
               max_waiting: int = 16, api_key: str | None = None) -> FastAPI:
    """The HTTP app over `service`. Past the service's `max_batch` running answers and
    `max_waiting` queued requests, a new request gets a 503 with Retry-After instead of a place in line.
    With `api_key`, every route but /health needs it as a bearer token."""
    in_flight = [0]  # touched only on the event loop

    def release(flag: list[bool]) -> None:
        if not flag[0]:
            flag[0] = True
            in_flight[0] -= 1

    app = FastAPI(title="rarecache", summary="chat completions with cross-model KV-cache handoff")
    app.state.service = service
    app.add_middleware(BodyLimit, limit=max_body)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)  # added last: runs first, before the body is read

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'malformed')})")
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return _error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(HTTPException)  # unknown paths, wrong methods, a body the framework cannot parse
    async def _http(request: Request, exc: HTTPException):
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = _why_unparsed(exc.__cause__)
        return _error(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)  # a bug of ours: still the one error shape (and still logged)
    async def _bug(request: Request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}")

    @app.get("/health")
    def health():
        running, waiting = service.load
        return {"status": "ok", "models": list(service.models), "requests_in_flight": in_flight[0],
                "answers_running": running, "requests_waiting": waiting, "max_batch": service.cfg.max_batch,
                "held_cache_bytes": service.held_bytes(), "handoff": _budget_info(service),
                "heal": getattr(service.cfg, "heal", False),  # (the vLLM service does not heal)
                "healed_positions": getattr(service, "healed", 0)}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "rarecache",
             "handoff_from": [a for (a, b) in service.maps if b == name]} for name in service.models]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        extra = req.model_extra or {}
        refused = [k for k in UNSUPPORTED if _asked(k, extra.get(k))]
        if refused:
            return _error(400, f"not supported by this server: {', '.join(refused)}")
        if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
            return _error(400, "max_tokens and max_completion_tokens disagree")
        wrong = req.refusal()
        if wrong is not None:
            return _error(400, wrong)
        if req.continue_final_message and not callable(getattr(service, "continue_final", None)):
            return _error(400, "not supported by this server's engine: continue_final_message")
        try:
            opts = req.rarecache or HandoffOptions()
            budget = {"rho": opts.rho, "selector": opts.selector}
            new = req.answer_tokens(default_max_tokens)
            sampling = None if new == 0 else SamplingConfig(max_new_tokens=new, temperature=req.temperature,
                                                            top_p=req.top_p, seed=req.seed)
            messages = [m.model_dump() for m in req.messages]
            if req.continue_final_message:  # tokenised, checked; the final message read after the rest
                prompt = service.prepare_continued(req.model, messages, sampling, req.stops(), req.cache_salt)
                call = partial(service.continue_final, req.model, prompt, sampling, req.stops(), salt=req.cache_salt,
                               logprobs=req.prompt_logprobs is not None, **budget)
            else:
                ids = service.prepare(req.model, messages, sampling, req.stops(), req.cache_salt)  # tokenised, checked
                call = partial(service.answer, req.model, ids, sampling, req.stops(), salt=req.cache_salt, **budget)
            service.check_budget(**budget)  # (answer checks it again; a stream must fail here, before it starts)
        except ModelNotFound as e:
            return _error(404, str(e), code="model_not_found")
        except (RarecacheError, ValueError) as e:
            return _error(400, str(e))
        if in_flight[0] >= service.cfg.max_batch + max_waiting:
            busy = _error(503, f"the server is busy ({in_flight[0]} requests ahead); retry later", kind="server_busy")
            busy.headers["Retry-After"] = "1"
            return busy
        in_flight[0] += 1
        done = [False]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
        if req.stream:  # released once the stream ends, however it ends
            return StreamingResponse(_stream(service, head, call, req), media_type="text/event-stream",
                                     background=BackgroundTask(release, done))
        try:
            reply = await run_in_threadpool(call)
        except RarecacheError as e:
            return _error(400, str(e))
        finally:
            release(done)
        body = {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text},
                             "finish_reason": reply.finish_reason}],
                "usage": _usage(reply), "rarecache": _info(service, reply)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = _prompt_logprobs(reply)
        return body

    return app
