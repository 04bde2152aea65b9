"""The written contract between the HTTP front and an engine: `ChatBackend`.

`serve/app.py` and `serve/metrics.py` serve whichever engine they are given, so they call what is
written here and nothing else: they never ask an engine what it is or whether it has a method. Two
engines implement it: our own (`ChatService`, serve/service.py) and vLLM's (`VllmChatService`,
adapters/vllm/server/serving.py). Written as a `typing.Protocol`, the way vLLM writes its KV connector
interface (`KVConnectorBase_V1`) and mlx-lm its cache: structural, so an engine's module need not
import this one to fit it, and a type checker holds both to it. `tests/test_contract.py` runs the same
requests through both and checks that the responses have the same shape and headers.

What both share besides the calls: one budget type (`config.Budget`, from `check_budget`), one reply
(`job.Reply`, which an engine may extend), one request in flight (`job.Job`: the stop-string and
streaming rule), the outcome words a router reads (`outcome.py`) and the short-prompt rule
(`config.too_short`). An engine that cannot do something a call asks for (the vLLM engine cannot
continue a final message) raises `RarecacheError` saying so, which the front answers with a 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Protocol

from ..engine.generate import SamplingConfig
from .job import Reply
from .request import Continued
from .settings import Budget


class Settings(Protocol):
    """The server's limits and budget, as the front reads them (`ServiceConfig`, `VllmServeConfig`)."""

    max_batch: int  # answers running at once; past it (and the front's max_waiting) a request gets a 503
    max_new_tokens: int  # the most one request may ask for
    request_budget: bool  # whether a request may name its own budget
    min_handoff_tokens: int  # shorter prompts are read by the model itself (config.too_short)

    @property
    def budget(self) -> Budget:
        """The server's own budget: what a request that names none is handed off with."""
        ...


class ChatBackend(Protocol):
    """What the HTTP front calls. `models`: served name -> the engine's model; `maps`: (source, target) ->
    its map, one entry per direction the engine hands off; `map_ids`: the same keys -> the map's id (its
    file's sha256; None where the engine does not know it)."""

    engine: str  # the response's `rarecache.engine`: "rarecache" or "vllm"
    streams_outcome: bool  # `answer` calls on_start with the outcome before the first token
    cfg: Settings
    models: Mapping[str, Any]
    maps: Mapping[tuple[str, str], Any]
    map_ids: Mapping[tuple[str, str], str | None]

    @property
    def load(self) -> tuple[int, int]:
        """(answers running, requests waiting)."""
        ...

    @property
    def healing(self) -> bool:
        """Whether idle time re-prefills the rows handoffs left (`serve --heal`)."""
        ...

    @property
    def healed(self) -> int:
        """Positions re-prefilled so far by healing."""
        ...

    def held_bytes(self) -> int:
        """Bytes of the rows the engine holds for reuse and handoff."""
        ...

    def store_stats(self) -> dict[str, Any]:
        """The row store's counters for /metrics: hits, misses, evictions, bytes, entries; per model under
        "models" where it keeps them."""
        ...

    def check_budget(self, rho: float | str | None = None, selector: str | None = None) -> Budget:
        """A request's own budget (None, None: the server's), checked; every mistake a RarecacheError."""
        ...

    def prepare(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig,
                stop: tuple[str, ...] = (), salt: str | None = None) -> list[int]:
        """Check a request and tokenise its prompt, before anything is queued (a ModelNotFound for a name
        the server does not have, a RarecacheError for any other mistake)."""
        ...

    def answer(self, model: str, ids: list[int], sampling: SamplingConfig, stop: tuple[str, ...] = (),
               on_text: Callable[[str], None] | None = None, cancelled: Callable[[], bool] | None = None,
               salt: str | None = None, *, rho: float | str | None = None, selector: str | None = None,
               mapper: str | None = None, on_start: Callable[[dict], None] | None = None) -> Reply:
        """Answer a prompt `prepare` checked: its rows kept, read by the model or handed off (the budget
        `rho`/`selector`; through the map of id `mapper` only, if named); `on_text` streams the answer,
        `cancelled()` True ends it; `on_start(outcome fields)` before the first token where
        `streams_outcome`. The reply carries its outcome (handoff_status, fallback_reason, mapper_id)."""
        ...

    def prepare_continued(self, model: str, messages: list[dict[str, str]], sampling: SamplingConfig | None,
                          stop: tuple[str, ...] = (), salt: str | None = None) -> Continued:
        """`prepare` for a request whose last message is the assistant's, to continue or score."""
        ...

    def continue_final(self, model: str, prompt: Continued, sampling: SamplingConfig | None,
                       stop: tuple[str, ...] = (), on_text: Callable[[str], None] | None = None,
                       cancelled: Callable[[], bool] | None = None, salt: str | None = None,
                       logprobs: bool = True, *, rho: float | str | None = None, selector: str | None = None,
                       mapper: str | None = None, on_start: Callable[[dict], None] | None = None) -> Reply:
        """`answer` for a `prepare_continued` prompt: the final message read (and scored) by the model."""
        ...

    def describe(self, reply: Reply) -> dict[str, Any]:
        """What the engine adds to a response's `rarecache` object beyond the fields every engine gives
        (app.py `_info`): its own words for what it did."""
        ...
