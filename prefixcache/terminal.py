"""What the command line does around a command: error lines and exit codes, log lines and the
progress bar on stderr, and Ctrl-C / SIGTERM. stdout is never written here."""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from . import compat
from .errors import EXIT_INTERNAL, Interrupted, PrefixcacheError
from .job import Event

err = Console(stderr=True, highlight=False, soft_wrap=True)


@contextmanager
def errors(debug: bool) -> Iterator[None]:
    """Library errors become `error: <message>` on stderr and their exit code; no traceback."""
    try:
        yield
    except typer.Exit:
        raise
    except Interrupted as exc:
        err.print(str(exc), markup=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code)
    except PrefixcacheError as exc:
        if debug:
            traceback.print_exc()
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        raise typer.Exit(130)
    except BrokenPipeError:
        sys.stderr.close()  # the reader went away (e.g. `| head`): not an error
        raise typer.Exit(0)
    except Exception as exc:
        if debug:
            traceback.print_exc()
        err.print(f"internal error: {type(exc).__name__}: {exc} (run with --debug for a traceback)", markup=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERNAL)


def setup_logging(quiet: bool, level: str = "info") -> None:
    """Library log messages (a one-time model conversion, lint warnings) go to stderr, one line each."""
    levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
    if level.lower() not in levels:
        raise typer.BadParameter(f"--log-level must be one of {', '.join(levels)}")
    logger = logging.getLogger("prefixcache")
    for handler in [h for h in logger.handlers if getattr(h, "prefixcache_cli", False)]:
        logger.removeHandler(handler)  # an earlier command in this process wrote to another stderr
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("prefixcache: %(message)s"))
    handler.prefixcache_cli = True
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.ERROR if quiet else levels[level.lower()])


@contextmanager
def progress(quiet: bool) -> Iterator[Callable[[Event], None]]:
    """What the CLI does as a run goes: once the input is checked, quiet the model libraries
    (their advice and progress bars would clutter stderr); while scoring, a Rich progress bar
    on stderr (a terminal only)."""
    bar = Progress(
        TextColumn("classifying"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(), console=err, disable=quiet or not err.is_terminal, transient=False,
    )
    task = None

    def on_event(event: Event) -> None:
        nonlocal task
        if event.phase == "checked":
            compat.quiet_libraries()
        elif event.phase == "scoring":
            bar.start()
            task = bar.add_task("classify", total=event.total, rate="")
        elif task is not None:
            bar.update(task, completed=event.written, rate=f"{event.rate:.1f} items/s")

    try:
        yield on_event
    finally:
        bar.stop()


@contextmanager
def signals() -> Iterator[list[int]]:
    """SIGINT/SIGTERM during scoring: note it (the run stops after the current batch); a second
    one stops at once."""
    stopped: list[int] = []

    def handler(signum, frame):
        if stopped:
            raise KeyboardInterrupt
        stopped.append(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopped
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
