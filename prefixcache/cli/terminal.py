"""What the command line does around a command: error lines and exit codes, log lines and the
progress bar on stderr, and Ctrl-C / SIGTERM. stdout is never written here."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn
from typer.core import TyperCommand, TyperGroup

from .. import compat
from ..errors import EXIT_INTERNAL, EXIT_USAGE, Interrupted, PrefixcacheError, shown
from ..run.job import Event
from .show import stamp


class _Plain:
    """Help as a shell user reads it: `SPEC ITEMS` in the usage line (not `{SPEC}`), and no type
    shown for a flag."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)  # type: ignore[misc]
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:  # a flag takes no value: show none (help, completion)
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class Command(_Plain, TyperCommand):
    """Every prefixcache command (`@app.command(cls=Command)`)."""


class Commands(_Plain, TyperGroup):
    """Usage errors (`--limit 0`, an unknown option) as one `error:` line and exit 2, like every
    other error, instead of a framed box; a missing command still shows the help."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        usage_error, no_args = compat.cli_usage_errors()
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False,
                                windows_expand_args=windows_expand_args, **extra)
        except no_args as exc:
            print(exc.ctx.get_help() if exc.ctx else "", file=sys.stderr)
            code = EXIT_USAGE
        except usage_error as exc:
            command = exc.ctx.command_path if exc.ctx else "prefixcache"
            print(f"error: {exc.format_message()} (see {command} -h)", file=sys.stderr)
            code = EXIT_USAGE
        except typer.Abort:
            code = 130
        except KeyboardInterrupt:  # a second Ctrl-C while the first stop unwinds: the stop stands, no traceback
            print("interrupted", file=sys.stderr)
            code = 130
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """Rich would exit with status 1; the command decides instead (see `reporting`, `errors`)."""
        self.quiet = True
        raise BrokenPipeError


err = _Console(stderr=True, highlight=False, soft_wrap=True)


@contextmanager
def errors(debug: bool) -> Iterator[None]:
    """Library errors become `error: <message>` on stderr and their exit code; no traceback."""
    try:
        yield
    except typer.Exit:
        raise
    except Interrupted as exc:
        err.print(shown(exc), markup=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code)
    except PrefixcacheError as exc:
        if debug:
            traceback.print_exc()
        err.print(f"{_lead()}error: {shown(exc)}", markup=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        raise typer.Exit(130)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as head expects
        detach_closed_streams()
        raise typer.Exit(0)
    except Exception as exc:
        if debug:
            traceback.print_exc()
        err.print(f"{_lead()}internal error: {type(exc).__name__}: {shown(exc)} (run with --debug for a traceback)", markup=False,
                  soft_wrap=True)
        raise typer.Exit(EXIT_INTERNAL)


def _lead() -> str:
    """Before an error line: nothing on a terminal; in a log read later (cron, CI) the time and
    the program, as every other line there."""
    return "" if err.is_terminal else stamp()


def detach_closed_streams() -> None:
    """Point stdout and stderr at /dev/null, so nothing at exit tries a pipe nobody reads."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass


@contextmanager
def reporting() -> Iterator[None]:
    """What is shown after the work is done and written: a closed stderr (`2>&1 | head -1`) or
    stdout must not turn a finished run into an error, or change its exit code."""
    try:
        yield
    except BrokenPipeError:
        detach_closed_streams()
    except (ValueError, AttributeError):  # I/O on a closed file, or a stream Python set to None (`>&-`)
        if not _a_stream_is_closed():
            raise  # a mistake of ours, not a closed stream
        detach_closed_streams()


def _a_stream_is_closed() -> bool:
    return any(stream is None or stream.closed for stream in (sys.stdout, sys.stderr))


class _ConsoleHandler(logging.Handler):
    """Log lines through the stderr console, so they print above a live progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            err.print(shown(self.format(record)), markup=False, highlight=False, soft_wrap=True)
        except BrokenPipeError:
            detach_closed_streams()
        except Exception:
            self.handleError(record)


def setup_logging(quiet: bool, level: str = "info") -> None:
    """Library log messages (a one-time model conversion, lint warnings) go to stderr, one line each."""
    levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
    if level.lower() not in levels:
        raise typer.BadParameter(f"--log-level must be one of {', '.join(levels)}")
    logger = logging.getLogger("prefixcache")
    for handler in [h for h in logger.handlers if getattr(h, "prefixcache_cli", False)]:
        logger.removeHandler(handler)  # an earlier command in this process wrote to another stderr
    handler = _ConsoleHandler()
    stamp = "" if err.is_terminal else "%(asctime)s "  # logs read later need the time
    handler.setFormatter(logging.Formatter(stamp + "prefixcache: %(message)s", "%Y-%m-%d %H:%M:%S"))
    setattr(handler, "prefixcache_cli", True)  # an earlier command's handler is found by it
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.ERROR if quiet else levels[level.lower()])


class Reporter:
    """Shows a run's events on stderr. On a terminal: a spinner while loading, then a progress bar
    with rate and ETA. Elsewhere (cron, CI logs): timestamped lines: a start line, a progress line
    every `interval` seconds, and the end line the CLI writes. Nothing with `quiet`."""

    def __init__(self, quiet: bool, interval: float):
        self.quiet, self.interval, self.tty = quiet, interval, err.is_terminal
        self.bar = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
            TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[eta]}"), console=err, transient=False,
            disable=quiet or not self.tty,
            redirect_stdout=False,  # stdout carries the records: the live display must never take it
            redirect_stderr=False,
        )
        self.task: TaskID | None = None
        self.started = self.last_line = 0.0
        self.scoring = False  # records are being written: a stop waits for the batch

    def __call__(self, event: Event) -> None:
        try:
            self._show(event)
        except BrokenPipeError:  # nobody reads stderr any more: the run goes on, silently
            detach_closed_streams()
            self.quiet = True

    def _show(self, event: Event) -> None:
        if event.phase == "loading":
            if self.task is None:  # the libraries load with the model, not before: a run with nothing to do skips them
                compat.quiet_libraries()
            self._loading(event.detail)
        elif event.phase == "scoring":
            self._scoring(event)
        elif event.phase == "batch":
            self._batch(event)

    def _loading(self, what: str) -> None:
        text = {"tokenizer": "loading the tokenizer", "model": "loading the model, prefilling the prefix"}[what]
        if self.task is None:
            self.bar.start()
            self.task = self.bar.add_task(text, total=None, rate="", eta="", count="")
        self.bar.update(self.task, description=text)

    def _scoring(self, event: Event) -> None:
        self.scoring = True
        self.started = self.last_line = time.monotonic()
        if self.task is None:
            self.bar.start()
            self.task = self.bar.add_task("", total=None, rate="", eta="", count="")
        total = None if event.total is None else event.already + event.total
        self.bar.update(self.task, description="classifying", total=total, completed=event.already,
                        count=_count(event.already, total), rate="first batch…")
        if not self.tty and not self.quiet:
            count = event.total if event.total is not None else "all"
            todo = f"{count} items to check (unchanged items keep their records)" if event.updating \
                else f"{count} items to score"
            log_line(f"start: {event.detail}; {todo}")

    def _batch(self, event: Event) -> None:
        eta = _eta(event)
        total = None if event.total is None else event.already + event.total
        done = event.already + event.written  # a resume counts what was written before
        if self.task is None:  # batches follow the start of scoring, which adds the task
            return
        self.bar.update(self.task, completed=done, rate=f"{event.rate:.1f} items/s",
                        eta=f"ETA {eta}" if eta else "", count=_count(done, total))
        now = time.monotonic()
        if not self.tty and not self.quiet and now - self.last_line >= self.interval:
            self.last_line = now
            of = f"/{event.already + event.total}" if event.total is not None else ""
            log_line(f"{done}{of} items, {event.rate:.1f} items/s" + (f", ETA {eta}" if eta else ""))

    def stopping(self, signum: int = signal.SIGINT) -> None:
        if self.quiet:
            return
        again = "Ctrl-C again" if signum == signal.SIGINT else f"send {signal.Signals(signum).name} again"
        say(f"stopping after this batch ({again} to abort)")


def _count(written: int, total: int | None) -> str:
    return f"{written}/{total}" if total is not None else str(written)


def _eta(event: Event) -> str:
    if event.total is None or not event.rate:
        return ""
    seconds = max(event.total - event.written, 0) / event.rate
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def bench_step() -> Callable[[str], None]:
    """`bench` says on stderr what it measures as it starts each part (it can take minutes)."""

    def step(text: str) -> None:
        try:
            say(f"bench: {text}" + ("…" if err.is_terminal else ""), style="dim")
        except BrokenPipeError:
            detach_closed_streams()

    return step


@dataclass
class _Stage:
    """The stage `steps` shows: its words, its bar and when a line last said it."""

    what: str | None = None
    task: TaskID | None = None
    last: float = 0.0


@contextmanager
def steps(quiet: bool, interval: float = 30.0) -> Iterator[Callable[[str, int, int], None]]:
    """A `step(what, done, total)` for commands that go through stages (tune): on a terminal a
    bar per stage (a spinner while `total` is 0), elsewhere a timestamped line as each stage
    starts and every `interval` seconds within one. Nothing with `quiet`."""
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                   console=err, transient=True, disable=quiet or not err.is_terminal, redirect_stdout=False,
                   redirect_stderr=False)
    state = _Stage()

    def step(what: str, done: int, total: int) -> None:
        try:
            count = f"{done}/{total}" if total else ""
            if what != state.what or state.task is None:
                state.what, state.last = what, time.monotonic()
                if state.task is not None:
                    bar.update(state.task, visible=False)
                state.task = bar.add_task(what, total=total or None, completed=done, count=count)
                if not quiet and not err.is_terminal:
                    log_line(what + (f": {total} items" if total else ""))
                return
            bar.update(state.task, completed=done, count=count)
            if not quiet and not err.is_terminal and time.monotonic() - state.last >= interval:
                state.last = time.monotonic()
                log_line(f"{what}: {count}")
        except BrokenPipeError:  # nobody reads stderr any more: go on silently
            detach_closed_streams()

    bar.start()
    try:
        yield step
    finally:
        bar.stop()


def log_line(text: str) -> None:
    """A timestamped line, for logs a person reads later."""
    err.print(stamp() + text, markup=False, soft_wrap=True)


def say(text: str, style: str | None = None) -> None:
    """A line on stderr: as it is on a terminal, timestamped in a log read later (cron, CI)."""
    if err.is_terminal:
        err.print(text, markup=False, soft_wrap=True, style=style)
    else:
        log_line(text)


@contextmanager
def progress(quiet: bool, interval: float = 30.0) -> Iterator[Reporter]:
    """The reporter `run_job` sends its events to, for the length of a run."""
    reporter = Reporter(quiet, interval)
    try:
        yield reporter
    finally:
        reporter.bar.stop()


STOP_GRACE = 10.0  # seconds a stop waits for the batch in flight before abandoning it


@contextmanager
def stopped_at_once(kept: str) -> Iterator[None]:
    """SIGINT/SIGTERM stop a command at once, saying in one line what was kept (`kept`)."""

    def handler(signum, frame):
        raise Interrupted(signum, f"interrupted by {signal.Signals(signum).name}: {kept}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def signals(reporter: Reporter | None = None) -> Iterator[list[int]]:
    """SIGINT/SIGTERM during scoring: note it and say so; the run stops after the current batch,
    or abandons it after STOP_GRACE seconds (its items are scored again by --resume). Before
    scoring starts, and at a second signal, it stops at once."""
    stopped: list[int] = []

    def now(signum: int, why: str) -> Interrupted:
        return Interrupted(signum, f"interrupted by {signal.Signals(signum).name}: {why}")

    def handler(signum, frame):
        if stopped:  # the second: stop now; the batch in flight is scored again by --resume
            raise now(signum, "stopped at once; finished records are kept (--resume continues)")
        if reporter and not reporter.scoring:  # still loading: nothing to finish, stop now
            raise now(signum, "stopped before any record was written")
        stopped.append(signum)
        signal.setitimer(signal.ITIMER_REAL, STOP_GRACE)
        if reporter:
            reporter.stopping(signum)

    def too_long(signum, frame):
        raise now(stopped[0], f"the batch in flight did not finish within {STOP_GRACE:.0f} s and was abandoned; "
                              f"finished records are kept (--resume continues)")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, too_long)
    try:
        yield stopped
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, old in previous.items():
            signal.signal(sig, old)
