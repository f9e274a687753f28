"""The output file's life: checked before any work, tied by a fingerprint to the spec, model and
input that wrote it, and resumed from what a previous run wrote. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import OutputError
from .items import is_stream
from .records import Record, Written, file_format, read_records, record_id

FINGERPRINT_SUFFIX = ".prefixcache.json"


def check_output(path: str | None, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written or would be overwritten."""
    if path is None or path == "-":
        return
    file_format(path)
    target = Path(path)
    if target.is_symlink():
        raise OutputError(f"{path}: is a symbolic link; name the file itself (prefixcache never writes through a link)")
    if target.is_dir():
        raise OutputError(f"{path}: is a directory")
    _writable(target)
    if target.exists() and target.stat().st_size > 0 and not (resume or overwrite):
        raise OutputError(f"{path}: already exists; use --resume to continue it, --update to bring it up to date "
                          f"with the input, or --overwrite to replace it")


def check_report(path: Path | None) -> None:
    """A report file asked for must be writable before the run, not found unwritable after it."""
    if path is None:
        return
    if Path(path).is_dir():
        raise OutputError(f"{path}: is a directory, not a report file")
    _writable(Path(path))


def _writable(target: Path) -> None:
    """The file's folder exists and may be written to, and so may the file if it exists."""
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{target}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise OutputError(f"{target}: not writable")


def truncate_partial(path: str, done: Written) -> bool:
    """Cut a partial trailing record off, so appending starts on a fresh line."""
    if done.size > done.end:
        with open(path, "r+b") as f:
            f.truncate(done.end)
        return True
    return False


def fingerprint_path(output: str) -> Path:
    return Path(output + FINGERPRINT_SUFFIX)


def write_fingerprint(output: str, fingerprint: Mapping[str, Any]) -> None:
    path = fingerprint_path(output)
    try:
        write_aside(path, (json.dumps(fingerprint, indent=2, sort_keys=True) + "\n").encode())
    except OSError as exc:
        raise OutputError(f"{path}: cannot write the run's fingerprint: {exc.strerror}")


def write_aside(path: Path, data: bytes) -> None:
    """Write `data` to a new file with an unpredictable name next to `path` (created exclusively,
    so no planted link is followed), then rename it over `path`. The file gets the mode a plain
    `open` would give it under the user's umask."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, default_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_mode() -> int:
    """The mode `open` gives a new file under the user's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


# Fingerprint keys a resume may not change, and how to ask for the old value again.
_OPTION_OF = {"gold": "--gold", "device": "--device", "dtype": "--dtype", "batch_size": "--batch-size",
              "batch_tokens": "--batch-tokens", "shard": "--shard"}
_THING_OF = {"spec": "another version of the spec file", "model": "another model"}


def read_fingerprint(output: str) -> dict[str, Any]:
    path = fingerprint_path(output)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OutputError(f"{output}: cannot continue it: {path.name} (the fingerprint of the run that wrote it) "
                          f"is missing; choose another output file, or --overwrite to start it again")
    except (OSError, json.JSONDecodeError):
        raise OutputError(f"{output}: cannot continue it: {path.name} is unreadable; choose another output file, "
                          f"or --overwrite to start it again")


def check_fingerprint(output: str, previous: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> None:
    """Refuse to continue an output written with another spec, model or options (the input is
    compared by `input_change`), saying what to add back."""
    changed = [k for k in fingerprint if k not in ("input", "input_bytes") and k in previous
               and previous[k] != fingerprint[k]]  # keys an older version did not record are not compared
    if not changed:
        return
    options = [f"{_OPTION_OF[k]} {previous[k]}" for k in changed if k in _OPTION_OF and previous.get(k) is not None]
    options += [f"no {_OPTION_OF[k]}" for k in changed if k in _OPTION_OF and previous.get(k) is None]
    things = [_THING_OF.get(k, f"another {k}") for k in changed if k not in _OPTION_OF]
    if options:
        raise OutputError(f"{output}: cannot continue it: it was written with {' and '.join(options)}; "
                          f"add {'them' if len(options) > 1 else 'it'} back to continue it, or choose another output file")
    raise OutputError(f"{output}: cannot continue it: it was written with {' and '.join(things)}; "
                      f"restore {'them' if len(things) > 1 else 'it'} to continue it, or choose another output file")


def input_change(path: str, previous: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> str:
    """"same" input as the run that wrote the output, "grown" (that input plus more bytes at the
    end), or "changed"."""
    if previous.get("input") == fingerprint["input"]:
        return "same"
    consumed = previous.get("input_bytes")
    if path != "-" and isinstance(consumed, int) and 0 < consumed < fingerprint["input_bytes"]:
        if file_digest(path, consumed) == previous.get("input"):
            return "grown"
    return "changed"


def file_digest(path: str, limit: int | None = None) -> str:
    """sha256 of a file's bytes (of its first `limit` bytes when given); "stdin" for "-" or any
    input that can be read only once."""
    if is_stream(path):
        return "stdin"
    h, left = hashlib.sha256(), limit if limit is not None else float("inf")
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(int(min(1 << 20, left)))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


@dataclass
class Start:
    """How a run starts on its output. mode: "fresh" (nothing kept), "resume" (the same input:
    keep the records, score the rest), "grown" (the input only grew: likewise), "update" (the input
    changed: rewrite the output, keeping the records of unchanged items)."""

    mode: str
    records: dict[str, Record]  # the existing output's complete records, by id text


def start_output(output: str | None, fingerprint: Mapping[str, Any], resume: bool, update: bool,
                 items: str) -> Start:
    """Decide how to continue an existing output (with `resume` or `update`), refusing one written
    with another spec, model or options. Nothing is written here."""
    if output is None or output == "-" or not (resume or update) or not Path(output).exists():
        return Start("fresh", {})
    previous = read_fingerprint(output)
    check_fingerprint(output, previous, fingerprint)
    # A stream cannot be compared before it is read: --update rewrites by id; --resume checks each
    # item already written as it streams.
    change = ("changed" if update else "same") if is_stream(items) else input_change(items, previous, fingerprint)
    if change == "changed" and not update:
        raise OutputError(f"{output}: cannot resume it: {items} changed since it was written (not only grew); "
                          f"--update keeps the records of unchanged items and scores new and changed ones")
    if change == "changed" and fingerprint.get("shard"):
        raise OutputError(f"{output}: a shard can only be continued on the same input; {items} changed")
    done = read_records(output)
    records = {record_id(r): r for r in done.records}
    if len(records) < len(done.records):
        twice = next(r for i, r in enumerate(done.records) if record_id(r) in map(record_id, done.records[:i]))
        raise OutputError(f"{output}: holds two records for item {twice.get('id')!r}; it was changed after it was "
                          f"written: choose another output file, or --overwrite to start it again")
    return Start("update" if change == "changed" else "resume" if change == "same" else "grown", records)


def continue_output(output: str, start: Start, fingerprint: Mapping[str, Any]) -> None:
    """Before appending to a resumed output: drop a partial last record, record the input now read."""
    done = read_records(output)
    if truncate_partial(output, done):
        logging.getLogger("prefixcache").warning("%s: dropped a partial last record left by an interrupted run", output)
    write_fingerprint(output, fingerprint)
