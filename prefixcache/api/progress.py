"""A progress bar for long calls from Python: tqdm in a notebook (when installed), Rich on a
terminal's stderr, nothing otherwise (a script's output stays its own)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional


class Bar:
    """`advance(n)` after each batch of n records."""

    def __init__(self, advance: Callable[[int], None] = lambda n: None):
        self.advance = advance


@contextmanager
def bar_for(enabled: bool, total: Optional[int]) -> Iterator[Bar]:
    if not enabled:
        yield Bar()
        return
    if "ipykernel" in sys.modules:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=total, unit="item", desc="classifying")
            try:
                yield Bar(bar.update)
            finally:
                bar.close()
            return
    if not sys.stderr.isatty():
        yield Bar()
        return
    yield from _rich(total)


def _rich(total: Optional[int]) -> Iterator[Bar]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress: Any = Progress(TextColumn("classifying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                             console=Console(stderr=True), transient=True, redirect_stdout=False,
                             redirect_stderr=False)
    with progress:
        task = progress.add_task("classifying", total=total)
        yield Bar(lambda n: progress.advance(task, n))
