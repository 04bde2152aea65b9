"""The HTTP front's door: OpenAI's error shape, the API key, the body size limit, unparsed bodies.

ASGI middlewares run before FastAPI reads a body, so a request without the key or with a body past
the limit is refused before it costs memory.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse


def error(status: int, message: str, kind: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body, the one shape of every error the server sends."""
    kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status, headers=headers)


class BearerAuth:
    """ASGI middleware: every path but /health needs `Authorization: Bearer <key>` (as vLLM's --api-key),
    else a 401 before the body is read. The scheme is case-insensitive (RFC 7235: `bearer KEY` too);
    the key is compared in constant time."""

    OPEN = ("/health",)

    def __init__(self, app, key: str):
        self.app, self.expected = app, key.encode()

    def allows(self, given: bytes) -> bool:
        scheme, _, token = given.partition(b" ")
        right = hmac.compare_digest(token.lstrip(b" "), self.expected)  # (compared whatever the scheme)
        return scheme.lower() == b"bearer" and right

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not self.allows(given):
                denied = error(401, "Incorrect or missing API key: send the header Authorization: Bearer KEY",
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
        too_big = error(413, f"the request body exceeds {self.limit} bytes")
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


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (application/json or application/*+json, any parameters), as
    the framework decides whether to parse a body."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def not_json(content_type: str | None) -> JSONResponse:
    """The 415 for a body sent as something other than JSON (the framework leaves it unparsed)."""
    given = f"Content-Type {content_type}" if content_type else "no Content-Type"
    return error(415, f"the body must be JSON, sent with Content-Type: application/json (got {given})")


def why_unparsed(cause: BaseException | None) -> str:
    """Why the framework could not parse a body (its own message only says that it could not)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8 ({cause.reason} at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "the body is not valid JSON (nested too deeply)"
    return f"the body is not valid JSON ({cause})" if cause is not None else "the body could not be parsed"
