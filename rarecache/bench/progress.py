"""A bench's progress on stderr: a bar over its timed rounds (rate, ETA) and a line per round with what it
measured, so a long cell is never silent (one 2048-token prefill of the 1.5B takes most of a minute on
2 AVX2 cores) and a slow machine shows itself before the table does."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from tqdm import tqdm


@contextmanager
def rounds(total: int, desc: str) -> Iterator[tqdm]:
    """A bar over `total` rounds (warm-ups included). Print table rows meanwhile with `table_row`."""
    bar = tqdm(total=total, unit="round", desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False,
               disable=None)  # a terminal only: a log keeps the lines
    try:
        yield bar
    finally:
        bar.close()


def round_lines(bar: tqdm, label: str, repeats: int, tokens: int, what: str) -> Callable[[int, float, float], None]:
    """An `on_round(i, prefill_s, other_s)` for the bench timers: ticks `bar` and says the round's times, the
    prefill's rate in tokens per second (`tokens` per prefill) and `what` the other time is."""
    def report(i: int, prefill: float, other: float) -> None:
        bar.update()
        tqdm.write(f"  {label}, round {i}/{repeats}{' (warm-up)' if not i else ''}: prefill {prefill:.2f} s "
                   f"({tokens / prefill:.0f} tok/s), {what} {other:.2f} s", file=sys.stderr)
    return report


def table_row(text: str) -> None:
    """A row of the bench's table on stdout, now (not after the buffer fills), below any bar."""
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()
