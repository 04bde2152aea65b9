"""The chat request's body as the HTTP front parses it: OpenAI's fields, strictly typed.

Pydantic checks types and ranges (as strictly as OpenAI: no coercion, no NaN); what the service can
check without the models (the combination of the scoring fields, unsupported fields asked for) is
here too; what needs the models (the template, the context length) is in serve/request.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .request import MAX_SALT, Role

UNSUPPORTED = ("n", "tools", "tool_choice", "functions", "function_call", "logprobs",
               "top_logprobs", "response_format", "frequency_penalty", "presence_penalty", "logit_bias")


def asked(key: str, value) -> bool:
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
