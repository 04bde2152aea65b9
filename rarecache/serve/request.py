"""A chat request checked at the door: every mistake a client can make, for either engine's service.

Validation lives apart from the scheduler so that the vLLM service (adapters/vllm/server/serving.py) and
the HTTP front apply the same rules as `ChatService`; a streamed answer has no way to report a
mistake once it has started, so all of it runs before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from ..engine.generate import SamplingConfig
from ..errors import RarecacheError

Role = Literal["system", "user", "assistant"]  # what a message's role may be (the HTTP front's schema too)
ROLES: tuple[str, ...] = get_args(Role)
MAX_STOP, MAX_STOP_CHARS = 4, 64  # OpenAI's limit on stop strings; a bound on what is held back
MAX_SALT = 1024  # characters of a cache salt
MAX_MAPPER_ID = 256  # characters of a map's id a router names (outcome.ROUTER_MAPPER)


class ModelNotFound(RarecacheError):
    pass


@dataclass(frozen=True)
class Continued:
    """A request ending in an assistant message to continue, as `prepare_continued` tokenised it."""

    ids: list[int]  # the prompt before the final message, with the template's generation prompt
    tokens: list[int]  # the final message's text, tokenised on its own (as `Conversation.score` reads an answer)


def check_text(value: Any, where: str) -> None:
    """The one rule for every string a client sends (content, model, stop, cache_salt, ..., and the keys
    of its objects): valid Unicode, so no lone surrogate (JSON's "\\ud800" decodes to one, which no
    tokenizer or UTF-8 writer takes). Walks lists and dicts, however deep (without recursion: a body
    may nest as deep as the JSON parser allows); `where` names the field in the error."""
    todo: list[tuple[Any, tuple]] = [(value, ())]  # (value, its path as a linked list: (parent path, step))
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RarecacheError(f"{_where(where, path)} is not valid Unicode text: a lone surrogate "
                                     f"(\\u{ord(value[e.start]):04x}) at character {e.start}") from None
        elif isinstance(value, dict):
            for k, v in value.items():
                todo += [(k, (path, None)), (v, (path, k))]
        elif isinstance(value, (list, tuple)):
            todo += [(v, (path, i)) for i, v in enumerate(value)]


def _where(where: str, path: tuple) -> str:
    """A field's name from `check_text`'s path: `messages[0].content`; a key: "a key of <its object>"."""
    steps = []
    while path:
        path, step = path
        steps.append(step)
    name = where
    for step in reversed(steps):
        if step is None:
            return f"a key of {name or 'the body'}"
        if isinstance(step, int):
            name = f"{name}[{step}]"
        else:
            step = step if isinstance(step, str) and step.isidentifier() else "?"
            name = f"{name}.{step}" if name else step
    return name or "the body"


def check_request(models, cfg, model: str, messages: list[dict[str, str]], sampling: SamplingConfig | None,
                  stop: tuple[str, ...] = (), salt: str | None = None, continue_final: bool = False) -> None:
    """Every mistake a client can make in a chat request, for any engine's service (`cfg` gives
    max_prompt_chars and max_new_tokens; `models` the names served). `continue_final`: the last
    message is the assistant's, to be continued (`sampling` None: read, with no answer)."""
    check_text(model, "model")
    if model not in models:
        raise ModelNotFound(f"unknown model {model!r}; this server has {', '.join(models)}")
    if not messages:
        raise RarecacheError("messages is empty")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RarecacheError(f"messages[{i}] needs a role ({', '.join(ROLES)}) and a string content")
        check_text(m["content"], f"messages[{i}].content")
    if continue_final and messages[-1]["role"] != "assistant":
        raise RarecacheError("continue_final_message needs the last message to be the assistant's (the text to "
                             f"continue), not the {messages[-1]['role']}'s")
    if not continue_final and messages[-1]["role"] == "assistant":
        raise RarecacheError("the last message is the assistant's; there is nothing to answer "
                             "(continue_final_message continues or scores it)")
    if sum(len(m["content"]) for m in messages) > cfg.max_prompt_chars:
        raise RarecacheError(f"the messages exceed {cfg.max_prompt_chars} characters")
    if sampling is not None and sampling.max_new_tokens > cfg.max_new_tokens:
        raise RarecacheError(f"max_tokens is at most {cfg.max_new_tokens} on this server")
    if len(stop) > MAX_STOP or any(not isinstance(x, str) or not 0 < len(x) <= MAX_STOP_CHARS for x in stop):
        raise RarecacheError(f"stop takes at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters")
    check_text(list(stop), "stop")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_SALT):
        raise RarecacheError(f"cache_salt is a string of 1 to {MAX_SALT} characters")
    check_text(salt, "cache_salt")


def check_mapper_id(value: str | None) -> str | None:
    """The map a router names for a request's handoff (its `x-vsr-kv-mapper-id` header), checked: None, or
    1 to MAX_MAPPER_ID printable ASCII characters without spaces (an id it matches against the server's maps;
    one that matches none is not an error: the prompt is read by the model itself, serve/outcome.py)."""
    if value is None:
        return None
    if not 0 < len(value) <= MAX_MAPPER_ID or not all("!" <= c <= "~" for c in value):
        raise RarecacheError(f"the x-vsr-kv-mapper-id header is 1 to {MAX_MAPPER_ID} printable characters "
                             "without spaces (the id of a map, its file's sha256)")
    return value
