"""The chat service's prefix-cache store: per model, the caches of recent token sequences.

An entry is one model's cache of one token sequence (a `Held`). A request is answered
from the entry that shares the longest prefix with its prompt: an entry whose whole
sequence is a prefix of the request is extended in place (the usual next turn of a
conversation); an entry that only shares part of it (another conversation with the
same system prompt, a regenerated answer) is copied up to the shared prefix, so
concurrent conversations never overwrite each other's rows. An entry a running
answer is still writing is `busy`: copied from, never extended by another request,
never evicted. Entries are evicted least recently used once their caches together
exceed the byte budget.

Every entry belongs to one salt (a tenant's `cache_salt`; None is a salt of its own):
`best` looks only at entries of the request's salt and `claim` makes entries of it, so
requests with different salts never share, copy or extend each other's rows, and no
request can learn from how fast it is answered whether another salt sent its prompt
(eviction and queueing still show how busy the server is, not what it was asked).

For the operator (`GET /metrics`), `stats` counts per model the claims that found rows (hits) or
none (misses), the entries evicted, and what is held now; the token sequences of the last
`EVICTED_KEPT` evicted entries are remembered (not their rows), so a request that finds no rows to
hand off from can say whether eviction is why (serve/outcome.py).

The store takes no locks: the service's worker thread is its only user (`stats` and `nbytes` may be
read from another thread: they only count).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ..engine.runner import Runner
from ..transfer.conversation import Held, common_prefix

EVICTED_KEPT = 64  # evicted entries whose token sequences are remembered, per model
COUNTS = ("hits", "misses", "evictions")


@dataclass(eq=False)  # entries are compared by identity
class Entry:
    held: Held
    salt: str | None = None  # only requests with this salt see the entry
    used: float = 0.0
    busy: bool = False  # a running answer is writing it


class PrefixStore:
    def __init__(self, models: Iterable[str], cache_bytes: int):
        self.entries: dict[str, list[Entry]] = {name: [] for name in models}
        self.cache_bytes = cache_bytes  # budget for the held caches of all models together
        self.counts = {name: dict.fromkeys(COUNTS, 0) for name in self.entries}
        self.evicted = {name: deque(maxlen=EVICTED_KEPT) for name in self.entries}  # (salt, token ids)

    def best(self, model: str, ids: list[int], salt: str | None = None) -> tuple[Entry | None, int]:
        """`model`'s entry of `salt` sharing the longest prefix with `ids`, and that prefix's length
        (None, 0 if none)."""
        best, n = None, 0
        for e in self.entries[model]:
            if e.salt != salt:
                continue
            k = common_prefix(e.held.ids, ids)
            if k > n:
                best, n = e, k
        return best, n

    def claim(self, model: str, runner: Runner, entry: Entry | None, shared: int, salt: str | None = None) -> Entry:
        """The entry of `salt` to answer from: `entry` (one `best` gave for that salt) itself when the
        request extends all of it and no running answer is writing it, else a new entry with a copy
        of its first `shared` rows (or an empty one)."""
        if entry is not None and entry.salt != salt:
            raise ValueError("an entry is claimed only by a request with its salt")
        self.counts[model]["hits" if entry is not None and shared > 0 else "misses"] += 1
        if entry is not None and shared == len(entry.held.ids) and not entry.busy:
            entry.busy = True
            return entry
        held = Held()
        if entry is not None and shared > 0:
            held.reserve(runner, shared).copy_prefix(entry.held.cache, shared)
            held.ids, held.approximate = entry.held.ids, list(entry.held.approximate)
            held.inexact_from = entry.held.inexact_from
            held.keep(shared)  # its bookkeeping of the first `shared` positions (Held.keep's rule)
        new = Entry(held, salt, busy=True)
        self.entries[model].append(new)
        return new

    def drop(self, model: str, entry: Entry) -> None:
        """Forget `entry` (its rows cannot be trusted), if the store still has it."""
        if entry in self.entries[model]:
            self.entries[model].remove(entry)

    def evict(self, keep: tuple[Entry, ...] = ()) -> None:
        """Drop least recently used entries past the byte budget; never a busy one or one in `keep`
        (the request that just finished keeps its own, whatever the budget)."""
        entries = [(e.used, name, e) for name, es in self.entries.items() for e in es]
        total = sum(e.held.nbytes for _, _, e in entries)
        for _, name, e in sorted(entries, key=lambda t: t[0]):
            if total <= self.cache_bytes:
                break
            if e.busy or any(e is k for k in keep):
                continue
            total -= e.held.nbytes
            self.entries[name].remove(e)
            self.counts[name]["evictions"] += 1
            self.evicted[name].append((e.salt, array("q", e.held.ids)))

    def evicted_longer(self, model: str, ids: list[int], salt: str | None, n: int) -> bool:
        """Whether an entry of `model` and `salt` evicted lately shared more than `n` positions with `ids`
        (and more than any entry held now shares)."""
        m = max(n, self.best(model, ids, salt)[1]) + 1  # the prefix it must have held
        want = array("q", ids[:m])
        return len(want) == m and any(s == salt and seq[:m] == want for s, seq in self.evicted[model])

    def stats(self) -> dict:
        """What /metrics shows: hits, misses, evictions (since start), bytes and entries (now), over all
        models, and the same per model under "models"."""
        per = {}
        for name, es in self.entries.items():
            es = list(es)  # (another thread may read while the worker changes the list)
            per[name] = {**self.counts[name], "bytes": sum(e.held.nbytes for e in es), "entries": len(es)}
        total = {k: sum(p[k] for p in per.values()) for k in (*COUNTS, "bytes", "entries")}
        return {**total, "models": per}

    def nbytes(self) -> int:
        """Bytes of all held caches (safe to read from another thread)."""
        return sum(e.held.nbytes for es in self.entries.values() for e in list(es))
