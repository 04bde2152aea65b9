"""vLLM engines driven by threads of ours, for the chat service (serving.py).

A served request needs more than `vllm.LLM.generate` gives: it streams text as tokens come,
ends at a stop string or when its client leaves, and joins a batch that is already running.
So each engine gets one thread that owns it outright (vLLM's engine client is not meant to be
shared between threads): between two steps it adds the requests that arrived, runs calls
such as `collective_rpc`, and aborts the requests that a stop string or a departed client
ended; then it steps the engine, whose scheduler batches everything running. Text is decoded
with our tokenizer and streamed by the one rule both engines' requests share (serve/job.py `Job.show`),
so stop strings and streaming behave the same as in ChatService. A request
of the quality gate (vllm_gate.py) carries a judge, which decides at its first token, before any text is
shown, whether it goes on.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ....errors import RarecacheError
from ....models.tokenizer import Tokenizer
from ....serve.job import Job
from .. import INSTALL_HINT


CONNECTOR = "rarecache.adapters.vllm.connector.connector"


def start_engine(path: Path, cfg: Any, maps: dict[str, str], engine_kwargs: dict[str, Any]):
    """A `vllm.LLM` of the checkpoint at `path` loading RarecacheConnector, under the service's settings `cfg`
    (serve_config.VllmServeConfig); `maps`: peer -> the map file it hands off from."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # the stdlib's own test for this
        raise RarecacheError("the vLLM service was started by a spawned process importing the script again: "
                             "start it under `if __name__ == \"__main__\":` (vLLM spawns its engine processes)")
    try:
        from vllm import LLM
        from vllm.config import KVTransferConfig
    except ImportError as e:
        raise RarecacheError(f"--engine vllm needs vllm ({e}); {INSTALL_HINT}") from None
    extra = {"store": str(cfg.store), "rho": cfg.rho, "selector": cfg.selector, "maps": maps,
             **({"store_bytes": cfg.store_bytes} if cfg.store_bytes else {}),
             **({"store_ttl": cfg.store_ttl} if cfg.store_ttl else {}),
             "accept_poor_map": cfg.accept_poor_map}
    ktc = KVTransferConfig(kv_connector="RarecacheConnector", kv_connector_module_path=CONNECTOR,
                           kv_role="kv_both", kv_connector_extra_config=extra,
                           kv_load_failure_policy="recompute")  # a failed handoff: vLLM prefills it itself
    kw = {"block_size": cfg.block_size, "max_model_len": cfg.max_model_len}
    return LLM(model=str(path), dtype=cfg.dtype, enforce_eager=not cfg.compile,
               skip_tokenizer_init=True, kv_cache_memory_bytes=cfg.kv_cache_bytes, max_num_seqs=cfg.max_batch,
               seed=0, kv_transfer_config=ktc, tensor_parallel_size=cfg.tensor_parallel_size,
               **{k: v for k, v in kw.items() if v is not None}, **engine_kwargs)


def engine_environment(environ=os.environ, tensor_parallel_size: int = 1) -> dict[str, str]:
    """vLLM's CPU thread settings, unless already set: every core this process may use goes to the
    engine's OpenMP threads (vLLM's default keeps one for its front end and halves the speed on
    a small machine); with tensor parallelism the cores are split evenly between the ranks
    (vLLM CPU binds rank r to the r-th `|`-separated list). Returns the settings in force."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    tp = tensor_parallel_size
    if type(tp) is not int or tp < 1:
        raise RarecacheError(f"tensor_parallel_size must be a positive integer, not {tp!r}")
    if tp > len(cores):
        raise RarecacheError(f"tensor_parallel_size {tp} needs a core per rank; this process may use {len(cores)}")
    per = len(cores) // tp
    wanted = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(_spans(cores[r * per:(r + 1) * per]) for r in range(tp)),
              "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(per)}
    for key, value in wanted.items():
        environ.setdefault(key, value)
    return {key: environ[key] for key in wanted}


def _spans(cores: list[int]) -> str:
    """Sorted core ids -> vLLM's list syntax: runs as a-b, joined by commas."""
    spans, start = [], cores[0]
    for a, b in zip(cores, cores[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ",".join(spans)


@dataclass(eq=False, kw_only=True)
class EngineJob(Job):
    """One request in an engine's thread: its tokens as vLLM returns them, checked for stop strings."""

    rid: str
    prompt: dict[str, Any]  # as vLLM takes it: prompt_token_ids, cache_salt
    params: Any  # vllm SamplingParams
    tokenizer: Tokenizer | None = None  # None: a raw request (tests, tools), kept as vLLM returns it
    first: float | None = None  # when the first token came
    ended: float | None = None
    output: Any = None  # the latest RequestOutput
    stopped: bool = False  # a stop string ended it
    judge: Callable[[Any], bool] | None = None  # the quality gate (vllm_gate.py): whether the request goes on
    rejected: bool = False  # the judge stopped it: nothing was given to on_text

    def take(self, out) -> bool:
        """Take a (cumulative) output; False once the request should be aborted."""
        self.output = out
        toks = list(out.outputs[0].token_ids) if out.outputs else []
        if toks and self.first is None:
            self.first = time.perf_counter()
        if toks and self.judge is not None:  # the first output with a token: before any text is shown
            judge, self.judge = self.judge, None
            if not judge(out):
                self.rejected = True
                return False
        if self.tokenizer is None or out.finished:
            return True
        try:
            self.stopped = self.show(self.tokenizer.decode(toks))
        except Exception as e:  # noqa: BLE001  (the client's side)
            self.error = e
            return False
        return not self.stopped and not self.gone()

    def end(self, error: BaseException | None = None) -> None:
        self.error = self.error or error
        self.ended = time.perf_counter()
        self.done.set()


class Engine:
    """One vLLM engine and the thread that feeds and steps it; nothing else touches the engine."""

    def __init__(self, name: str, llm):
        self.name, self.llm, self.core = name, llm, llm.llm_engine
        self.block_size: int = self.core.vllm_config.cache_config.block_size
        self.max_model_len: int = self.core.model_config.max_model_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict[str, EngineJob] = {}
        self._thread = threading.Thread(target=self._loop, name=f"rarecache-vllm-{name}", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[EngineJob]) -> None:
        """Add `jobs` to the engine together, between two steps (so they may be scheduled in one)."""
        self._inbox.put(jobs)

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(llm) on the engine's thread between steps (e.g. a collective_rpc) and return its result."""
        fut: Future = Future()
        self._inbox.put((fn, fut))
        return fut.result()

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join()
        self.core.engine_core.shutdown()

    def _loop(self) -> None:
        while True:
            items = [self._inbox.get()] if not self.jobs else []
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is None:
                    self._abort(list(self.jobs), RarecacheError("the service is closed"))
                    return
                if isinstance(item, tuple):
                    fn, fut = item
                    try:
                        fut.set_result(fn(self.llm))
                    except Exception as e:  # noqa: BLE001
                        fut.set_exception(e)
                    continue
                for job in item:
                    try:
                        self.core.add_request(job.rid, job.prompt, job.params)
                        self.jobs[job.rid] = job
                    except (ValueError, TypeError) as e:  # vLLM's own checks of a request
                        job.end(RarecacheError(f"vLLM refused the request: {e}"))
                    except Exception as e:  # noqa: BLE001  (fails the request, not the thread)
                        job.end(e)
            if self.jobs and not self.core.has_unfinished_requests():  # vLLM dropped them: never wait on them
                self._abort(list(self.jobs), RarecacheError("vLLM ended the request without an answer"))
            try:
                outs = self.core.step() if self.jobs else []
            except Exception as e:  # noqa: BLE001  (a dead engine: every request fails, loudly)
                self._abort(list(self.jobs), e)
                continue
            ended = []
            for out in outs:
                job = self.jobs.get(out.request_id)
                if job is None:
                    continue
                try:
                    going = job.take(out)
                except Exception as e:  # noqa: BLE001  (a bug of ours fails this request, not the thread)
                    job.error, going = e, False
                if out.finished:
                    self.jobs.pop(job.rid).end()
                elif not going:
                    ended.append(job.rid)
            ended += [rid for rid, j in self.jobs.items() if j.gone() and rid not in ended]
            self._abort(ended)

    def _abort(self, rids: list[str], error: BaseException | None = None) -> None:
        if not rids:
            return
        try:
            self.core.abort_request(rids)
        except Exception:  # noqa: BLE001  (a dead engine has nothing left to abort)
            pass
        for rid in rids:
            self.jobs.pop(rid).end(error)
