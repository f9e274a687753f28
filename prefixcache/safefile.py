"""The one writer of files: every file prefixcache writes is opened here, and nowhere else.

A folder another local user can write (a shared output folder, /tmp without its sticky bit) lets
that user plant a symbolic link, a FIFO or a file of theirs where the program is about to write.
So nothing is ever opened for writing by a path that could lead elsewhere:

- a whole file (a report, the fingerprint, a tuned spec, merged parts, a stored prefix) is written
  to a new file beside its target, created under an unpredictable name with O_EXCL|O_NOFOLLOW,
  flushed to disk and renamed over the target (a rename replaces a planted link itself, never what
  it points to); a failure removes the new file and leaves the target as it was (`replacing`);
- a file that grows as the run goes (the output) is created the same way and renamed into place
  before its first record (`create`); one continued (`--resume`, a Markdown summary appended to)
  is opened with O_NOFOLLOW|O_NONBLOCK and used only when it is a regular file of the running
  user (`append`), and so is a lock file (`lock_file`);
- a target that is a link, a FIFO, a device or a folder is refused before any work (`check_target`).

Errors are `OutputError`s naming the file. The new files get the mode `open` would give them under
the user's umask. Ground module: imports only the standard library and errors.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Union

from .errors import OutputError

PathLike = Union[str, "os.PathLike[str]"]
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO must not block the open
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
TEMP_SUFFIX = ".part"
_TEMP = re.compile(r"\.(?P<target>.+)\.[0-9a-f]{16}" + re.escape(TEMP_SUFFIX))


def folder_of(path: PathLike) -> Path:
    parent = Path(path).parent
    return parent if str(parent) else Path(".")


def what_it_is(mode: int) -> str:
    """A file type in words, for messages."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return words
    return "not a regular file"


def check_target(path: PathLike, what: str = "") -> None:
    """Refuse, before any work, a target prefixcache must not write: a link (even a dangling
    one), a FIFO, a device or a folder, or one in a folder that is missing or not writable."""
    label = f"{what} {path}" if what else str(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise OutputError(f"{label}: cannot be written: {exc.strerror}")
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise OutputError(f"{label}: is a symbolic link; name the file itself (prefixcache never writes through a link)")
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{label}: is a directory, not a file")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{label}: is {what_it_is(st.st_mode)}, not a regular file; prefixcache writes only regular files")
    parent = folder_of(path)
    if not parent.is_dir():
        raise OutputError(f"{label}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (st is not None and not os.access(path, os.W_OK)):
        raise OutputError(f"{label}: not writable")


def new_beside(path: PathLike, mode: int = 0o666) -> tuple[int, Path]:
    """A new, empty file next to `path` under an unpredictable name, created exclusively (a name
    planted in the meantime fails the create instead of being followed), with `mode` cut by the
    umask."""
    target = Path(path)
    for _ in range(100):
        temp = folder_of(target) / f".{target.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
        except FileExistsError:
            continue
        return fd, temp
    raise FileExistsError(f"{target}: no free temporary name beside it")  # pragma: no cover


def is_temporary_of(name: str, target_name: str) -> bool:
    """Whether the file name `name` is one of `new_beside`'s for a target named `target_name`."""
    found = _TEMP.fullmatch(name)
    return bool(found and found.group("target") == target_name)


def _refuse_special(path: Path) -> None:
    """The target of a rename may be missing or a regular file; a link is replaced, never
    followed, but is refused all the same (it was planted: say so instead of hiding it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{path}: is {what_it_is(st.st_mode)}, not a regular file; not replaced "
                          f"(prefixcache never writes through a link)")


@contextmanager
def replacing(path: PathLike, text: bool = False, what: str = "the file", mode: int = 0o666) -> Iterator[IO]:
    """A stream whose content replaces `path` when the block ends without error: written to a
    new file beside it (`mode` cut by the umask), flushed to disk, renamed over it. On an error,
    `path` is as it was."""
    target = Path(path)
    fd, temp = _temporary(target, what, mode)
    stream: IO = os.fdopen(fd, "wb")
    stream.raw.name = str(target)  # type: ignore[attr-defined]  # messages name the target
    if text:
        stream = io.TextIOWrapper(stream, encoding="utf-8", newline="")
    try:
        yield stream
        stream.flush()
        os.fsync(stream.fileno())
        stream.close()
        _refuse_special(target)  # planted while we wrote: refused, not replaced
        os.replace(temp, target)
    except OSError as exc:
        _discard(stream, temp)
        raise OutputError(f"{target}: cannot write {what}: {exc.strerror or exc}")
    except BaseException:
        _discard(stream, temp)
        raise


def _temporary(target: Path, what: str, mode: int = 0o666) -> tuple[int, Path]:
    """`new_beside(target)`, for a target that may be replaced."""
    _refuse_special(target)
    try:
        return new_beside(target, mode)
    except OSError as exc:
        raise OutputError(f"{target}: cannot write {what}: {exc.strerror or exc}")


def _discard(stream: IO, temp: Path) -> None:
    try:
        stream.close()
    except OSError:
        pass
    try:
        os.unlink(temp)
    except OSError:
        pass


def replace(path: PathLike, data: bytes | str, what: str = "the file", mode: int = 0o666) -> None:
    """Write `data` as the whole of `path` (see `replacing`)."""
    with replacing(path, text=isinstance(data, str), what=what, mode=mode) as f:
        f.write(data)


def create_once(path: PathLike, data: bytes, mode: int = 0o600) -> None:
    """Put `data` at `path` unless a file is there already (then that one stands): written whole
    beside it, then linked in, so a racing writer sees all of it or none."""
    fd, temp = new_beside(path, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.link(temp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(temp)


def create(path: PathLike, what: str = "the output") -> IO[str]:
    """A new, empty text file put in place at `path` at once (replacing what was there), open
    for writing: for a file written record by record, which a crash must leave where it is."""
    target = Path(path)
    fd, temp = _temporary(target, what)
    stream = _text(fd, target)
    try:
        _refuse_special(target)  # planted meanwhile: refused, not replaced
        os.replace(temp, target)
    except OSError as exc:
        _discard(stream, temp)
        raise OutputError(f"{target}: cannot write {what}: {exc.strerror or exc}")
    except BaseException:
        _discard(stream, temp)
        raise
    return stream


def _text(fd: int, path: Path) -> IO[str]:
    stream = open(fd, "w", encoding="utf-8", newline="", closefd=True)
    stream.buffer.raw.name = str(path)  # type: ignore[attr-defined]  # messages name the file, not the descriptor
    return stream


def _open_own(path: PathLike, flags: int, what: str, mode: int = 0o666) -> int:
    """A descriptor of `path` opened without following a link or blocking on a FIFO, checked to
    be a regular file of the running user (anything else is closed and refused)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, mode)
    except OSError as exc:
        if os.path.islink(path):
            raise OutputError(f"{path}: is a symbolic link; prefixcache never writes through a link (remove it)")
        raise OutputError(f"{path}: cannot open {what}: {exc.strerror or exc}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{path}: is {what_it_is(st.st_mode)}, not a regular file; remove it")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise OutputError(f"{path}: belongs to another user (uid {st.st_uid}); prefixcache writes only the "
                              f"running user's files: remove it or write elsewhere")
        if _NONBLOCK and hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append(path: PathLike, keep: int | None = None, what: str = "the file") -> IO[str]:
    """`path` open for appending text (created when missing); it must be a regular file of the
    running user. `keep`: cut the file to its first `keep` bytes first (a partial last record)."""
    fd = _open_own(path, os.O_RDWR | os.O_CREAT, what)
    try:
        if keep is not None and os.fstat(fd).st_size > keep:
            os.ftruncate(fd, keep)
        os.lseek(fd, 0, os.SEEK_END)
    except OSError as exc:
        os.close(fd)
        raise OutputError(f"{path}: cannot write {what}: {exc.strerror or exc}")
    return _text(fd, Path(path))


def lock_file(path: PathLike) -> int:
    """A read-write descriptor of the lock file `path` (created when missing), a regular file of
    the running user."""
    return _open_own(path, os.O_RDWR | os.O_CREAT, "the lock file", 0o600)


def same_entry(fd: int, path: PathLike) -> bool:
    """Whether the descriptor is the file `path` names now (a link at `path` is not)."""
    try:
        st, now = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)
