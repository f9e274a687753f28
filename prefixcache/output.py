"""The output file's life: checked before any work, tied by a fingerprint to the spec, model and
input that wrote it, and resumed from what a previous run wrote. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from .errors import OutputError
from .records import Record, Written, file_format, read_records, record_id

FINGERPRINT_SUFFIX = ".prefixcache.json"


def check_output(path: str | None, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written or would be overwritten."""
    if path is None or path == "-":
        return
    file_format(path)
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{path}: is a directory")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise OutputError(f"{path}: not writable")
    if target.exists() and target.stat().st_size > 0 and not (resume or overwrite):
        raise OutputError(f"{path}: already exists; use --resume to continue it or --overwrite to replace it")


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
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write the run's fingerprint: {exc.strerror}")


def check_fingerprint(output: str, fingerprint: Mapping[str, Any]) -> None:
    """Refuse to resume an output written by another spec, model or input."""
    path = fingerprint_path(output)
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OutputError(f"{output}: cannot resume: {path.name} (the fingerprint of the run that wrote it) is missing; "
                          f"use --overwrite to start again")
    except (OSError, json.JSONDecodeError):
        raise OutputError(f"{output}: cannot resume: {path.name} is unreadable; use --overwrite to start again")
    changed = [k for k in fingerprint if previous.get(k) != fingerprint[k]]
    if changed:
        raise OutputError(f"{output}: cannot resume: it was written with a different {', '.join(changed)}; "
                          f"use --overwrite to start again, or another output file")


def file_digest(path: str) -> str:
    """sha256 of a file's bytes ('stdin' for '-')."""
    if path == "-":
        return "stdin"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def start_output(output: str | None, resume: bool, fingerprint: Mapping[str, Any]) -> dict[str, Record]:
    """Fresh output: record the fingerprint. Resumed output: check it, drop a partial trailing
    record, and return the records already written, by str(id)."""
    log = logging.getLogger("prefixcache")
    if output is None or output == "-":
        return {}
    if resume and Path(output).exists():
        check_fingerprint(output, fingerprint)
        done = read_records(output)
        if truncate_partial(output, done):
            log.warning("%s: dropped a partial last record left by an interrupted run", output)
        log.info("%s: %d records already written; resuming", output, len(done.records))
        return {record_id(r): r for r in done.records}
    write_fingerprint(output, fingerprint)
    return {}
