"""One writer per output: an exclusive lock held for as long as a run (or `merge`) writes it.

Two cron runs that overlap on one output would interleave their records; the second one is
refused instead, naming the one at work. The lock is `flock` on `.<output>.lock` beside the output,
which says who holds it (pid, start, command). The kernel drops it when its holder dies, kill -9
included, so a lock file left behind never blocks a later run. Where `flock` does not exist
(Windows), outputs are not locked.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from ..errors import OutputError, shown
from ..safefile import lock_file, same_entry

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def lock_path(output: str | Path) -> Path:
    target = Path(output)
    return target.with_name(f".{target.name}.lock")


@contextmanager
def output_lock(output: Optional[str], what: str = "run") -> Iterator[None]:
    """Hold the output's lock for the block; OutputError (exit 2) when another process holds it.
    No lock for stdout (None or "-")."""
    if output in (None, "-") or fcntl is None:
        yield
        return
    path = lock_path(output)
    fd = _acquire(path, output)
    try:
        _say_who(fd, output, path, what)
        yield
    finally:
        try:
            if same_entry(fd, path):
                path.unlink()
        except OSError:
            pass
        os.close(fd)  # releases the lock


def _say_who(fd: int, output: str, path: Path, what: str) -> None:
    """Write who holds the lock into it (a full disk is the output's error, as writing it would be)."""
    line = f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}: {_command(what)}\n"
    try:
        os.ftruncate(fd, 0)
        os.write(fd, line.encode())
    except OSError as exc:
        raise OutputError(f"{output}: cannot write its lock file {path.name}: {exc.strerror or exc}")


def _acquire(path: Path, output: str) -> int:
    """A descriptor of the lock file, locked; the file at `path` is the one locked (a holder that
    removed it as it finished leaves a new one to lock)."""
    while True:
        try:
            fd = lock_file(path)
        except OutputError as exc:
            raise OutputError(f"{output}: cannot lock it: {exc}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputError(f"{output}: another prefixcache process is writing it ({holder}); wait for it to "
                              f"finish, or write to another file")
        except OSError:  # a file system without locks: go on unlocked, as before
            return fd
        if same_entry(fd, path):
            return fd
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return shown(text.splitlines()[0][:300]) if text else "its lock file says no more"


def _command(what: str) -> str:
    """The holder's command line as it was typed, or what it does when not run as `prefixcache`."""
    first = Path(sys.argv[0]).name if sys.argv else ""
    if first == "prefixcache" or (first == "__main__.py" and Path(sys.argv[0]).parent.name == "prefixcache"):
        return " ".join(["prefixcache", *sys.argv[1:]])[:500]
    return f"prefixcache {what}, from {first or 'Python'}"
