"""How a run starts on its output and continues it. No torch.

- the fingerprint next to the output (`<output>.prefixcache.json`, read and written in
  output.py): continuing the output with another spec, model, input or option is refused, naming
  what changed;
- how a run starts on it (`Start`): fresh, resume, grown or update, and the checks that the
  records already there are the input's first items (a stream too, as it is read);
- `OutputFile.writing`: appends to a fresh or resumed output; writes an updated one aside and
  renames it over the old one only when complete; `remove_orphans` sweeps what a killed writer
  left.
"""

from __future__ import annotations

import glob
import hashlib
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from .. import safefile
from ..errors import InputError, OutputError
from .items import Item, is_stream
from .records import Record, id_text, item_sha, record_id, repeated

from .output import (RecordWriter, fingerprint_path, open_writer,
                     read_fingerprint, read_records, write_fingerprint)

log = logging.getLogger("prefixcache")


Named = Callable[[str, Any], Optional[str]]  # a fingerprint key and value -> the option that gives it, or None
EXACT_BOUND = "exact_bound"  # --exact: the re-scoring bound reached, kept for a run that continues the output

BATCH_MOVES = "scores_move_with_batch"  # derived from the engine and precision
_THING_OF = {"spec": "another version of the spec file", "model": "another model",
             BATCH_MOVES: "another rule for whether its scores move with the batch (another prefixcache version)",
             "engine_version": "another version of its engine (its numbers may differ)",
             "of": "another number of items (--limit)"}


def check_fingerprint(output: str, previous: Mapping[str, Any], fingerprint: Mapping[str, Any],
                      named: Named = lambda key, value: None) -> None:
    """Refuse to continue an output written with another spec, model or options (the input is
    compared by `input_change`), saying what to add back: `named` gives the command-line words of
    an option's old value ("--keep id,text", "no --exact")."""
    changed = [k for k in fingerprint if k not in ("input", "input_bytes") and k in previous
               and previous[k] != fingerprint[k]]  # keys an older version did not record are not compared
    if "engine" in changed:  # its version and precision follow from the engine: naming the engine says all
        changed = [k for k in changed if k not in ("engine_version", "dtype", BATCH_MOVES)]
    if "dtype" in changed:  # whether the scores move with the batch follows from the precision
        changed = [k for k in changed if k != BATCH_MOVES]
    if not changed:
        return
    if changed == ["gold"]:
        _gold_changed(output, previous["gold"], fingerprint["gold"])
    said = {k: named(k, previous[k]) for k in changed}
    # an engine is named beside the one this run would have scored with
    options = [w + (f" (this run: {fingerprint[k]})" if k == "engine" else "") for k, w in said.items() if w]
    things = [_THING_OF.get(k, f"another {k}") for k, w in said.items() if not w]
    if options:
        raise OutputError(f"{output}: cannot continue it: it was written with {' and '.join(options)}; "
                          f"add {'them' if len(options) > 1 else 'it'} back to continue it, or choose another output file")
    raise OutputError(f"{output}: cannot continue it: it was written with {' and '.join(things)}; "
                      f"restore {'them' if len(things) > 1 else 'it'} to continue it, or choose another output file")


def _gold_changed(output: str, before: Optional[str], now: Optional[str]) -> None:
    """A gold field given (or changed) for an output already written: its records carry the gold
    values they were written with, so evaluating against another field means new records."""
    target = Path(output)
    other = target.with_name(f"{target.stem}.{now or 'nogold'}{target.suffix}")
    was = f"with gold field {before!r}" if before else "without a gold field"
    if now:
        raise OutputError(f"{output}: was written {was}, so its records hold no {now!r} values to evaluate; "
                          f"write the evaluated run to another output (-o {other} --gold {now}); "
                          f"or drop --gold {now} to continue this one")
    raise OutputError(f"{output}: was written {was}; give --gold {before} to continue it, or write to another "
                      f"output (-o {other})")


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


# -- how a run starts on the output ---------------------------------------------------------------
@dataclass
class Start:
    """How a run starts on its output. mode: "fresh" (nothing kept), "resume" (the same input:
    keep the records, score the rest), "grown" (the input only grew: likewise), "update" (the input
    changed: rewrite the output, keeping the records of unchanged items)."""

    mode: str
    records: dict[str, Record]  # the existing output's complete records, by id text

    @property
    def appends(self) -> bool:
        """Records go after those already there (resume, grown)."""
        return self.mode in ("resume", "grown")

    @property
    def done(self) -> Mapping[str, Record]:
        """Records this run need not write again (none when updating: it writes them all)."""
        return {} if self.mode == "update" else self.records


def start_output(output: str | None, fingerprint: Mapping[str, Any], resume: bool, update: bool,
                 items: str, named: Named = lambda key, value: None, fmt: str | None = None) -> Start:
    """Decide how to continue an existing output (with `resume` or `update`), refusing one written
    with another spec, model or options. Nothing is written here."""
    if output is None or output == "-" or not (resume or update) or not Path(output).exists():
        return Start("fresh", {})
    previous = read_fingerprint(output)
    check_fingerprint(output, previous, fingerprint, named)
    # A stream cannot be compared before it is read: --update rewrites by id; --resume checks each
    # item already written as it streams (`checked_stream`).
    change = ("changed" if update else "same") if is_stream(items) else input_change(items, previous, fingerprint)
    if change == "changed" and not update:
        raise OutputError(f"{output}: cannot resume it: {items} changed since it was written (not only grew); "
                          f"--update keeps the records of unchanged items and scores new and changed ones")
    if change == "changed" and fingerprint.get("shard"):
        raise OutputError(f"{output}: a shard can only be continued on the same input; {items} changed")
    done = read_records(output, fmt)
    twice = repeated(done.records)
    if twice is not None:
        raise OutputError(f"{output}: holds two records for item {twice.get('id')!r}; it was changed after it was "
                          f"written: choose another output file, or --overwrite to start it again")
    records = {record_id(r): r for r in done.records}
    return Start("update" if change == "changed" else "resume" if change == "same" else "grown", records)


def in_input_order(output: str, start: Start, items: Iterator[Item], source: str, update: bool = False) -> Start:
    """An output being continued holds the first items of its input, in order (records are only
    ever appended); anything else was changed after it was written, and appending would mix. An
    input that grew may also have changed an item already written (an export read while it was
    being written ends in a half-written row): `update` then rewrites the output (the item is
    scored again), a resume is refused."""
    changed = []
    for n, (item, key) in enumerate(zip(items, start.records), 1):
        if id_text(item.id) != key:
            raise OutputError(f"{output}: record {n} is item {key!r}, but item {n} of {source} is "
                              f"{item.id!r}; the output was changed after it was written: --update rewrites it")
        sha = start.records[key].get("item_sha")
        if sha is not None and sha != item_sha(item.record):
            changed.append(item.id)
    if changed and update:
        log.info("%s: %d items already written changed in %s (first: %r); scoring them again", output, len(changed),
                 source, changed[0])
        return Start("update", start.records)
    if changed:
        raise OutputError(f"{output}: item {changed[0]!r} changed in {source} since its record was written (an export "
                          f"read while it was being written?); --update scores it again")
    return start


def checked_stream(items: Iterator[Item], name: str, written: Mapping[str, Record]) -> Iterator[Item]:
    """What the scan before the run checks for a file, for input that can be read only once:
    unique ids; and, when continuing an output, that an item already written is the same item."""
    seen: dict[str, int] = {}
    label = "<stdin>" if name == "-" else name
    order = list(written)  # records are only ever appended: the input starts with their items, in order
    for n, item in enumerate(items):
        key = id_text(item.id)
        if key in seen:
            raise InputError(f"{label}:{item.line}: duplicate id {item.id!r} (first on line {seen[key]})")
        seen[key] = item.line
        if n < len(order) and key != order[n]:
            raise InputError(f"{label}:{item.line}: item {item.id!r} is where the output has item {order[n]!r}; "
                             f"this is not the input the output was started with")
        old = written.get(key)
        if old is not None and old.get("item_sha") not in (None, item_sha(item.record)):
            raise InputError(f"{label}:{item.line}: item {item.id!r} differs from the one already written to the "
                             f"output; this is not the input the output was started with")
        yield item
    if len(seen) < len(order):  # the records of items no longer in the input would stay
        raise InputError(f"{label}: ended after {len(seen)} items, but the output already holds {len(order)} "
                         f"records (the next: item {order[len(seen)]!r}); this is not the input the output was "
                         f"started with: give the whole input, or --update to rewrite the output from this one")


def continue_output(output: str, fingerprint: Mapping[str, Any], fmt: str | None = None) -> None:
    """Before appending to a resumed output: drop a partial last record (what an interrupted run
    leaves), record the input now read."""
    done = read_records(output, fmt)
    if done.size > done.end:
        safefile.append(output, keep=done.end, what="the output").close()
        log.warning("%s: dropped a partial last record left by an interrupted run", output)
    write_fingerprint(output, fingerprint)


# -- writing ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutputFile:
    """Where a run writes its records: a file (None or "-": stdout), in `fmt`, with these CSV
    `columns` and the id column under the input's name for it."""

    path: Optional[str]
    fmt: str = "jsonl"
    columns: Sequence[str] = ()
    id_column: str = "id"

    @property
    def is_file(self) -> bool:
        return self.path not in (None, "-")

    @property
    def file(self) -> str:
        """The output file's path (resuming, updating and fingerprints need one; stdout is refused
        before any of them)."""
        if self.path is None or self.path == "-":
            raise ValueError("the output is stdout, not a file")
        return self.path

    @contextmanager
    def writing(self, start: Start, fingerprint: Mapping[str, Any]) -> Iterator[RecordWriter]:
        """A writer for this run's records. Fresh: the records, then the fingerprint (a run that
        fails before its first record leaves no output behind). Resumed: a partial last record
        dropped, the fingerprint renewed, records appended. Updated: written aside and renamed over
        the output only when complete (the output stays as it was if the run fails)."""
        if start.mode == "update":
            with safefile.replacing(self.file, text=True, what="the output") as stream:
                writer = RecordWriter(stream, self.fmt, self.columns, id_column=self.id_column)
                yield writer
            write_fingerprint(self.file, fingerprint)
            return
        if start.mode != "fresh":
            continue_output(self.file, fingerprint, self.fmt)
            log.info("%s: %d records already written; resuming", self.path, len(start.records))
        writer = open_writer(self.path, self.columns, append=start.appends, fmt=self.fmt, id_column=self.id_column)
        if start.mode == "fresh" and self.is_file:
            write_fingerprint(self.file, fingerprint)
        try:
            yield writer
        except BaseException:
            writer.close(failing=True)
            if start.mode == "fresh" and self.is_file and not writer.written:
                Path(self.file).unlink(missing_ok=True)  # nothing was written: nothing to refuse the next run with
                fingerprint_path(self.file).unlink(missing_ok=True)
            raise
        writer.close()


def remove_orphans(output: str) -> None:
    """Remove what writers of `output` killed mid-write left beside it (an update's aside, a
    fingerprint's temporary). Called with the output's lock held, so no live writer owns one."""
    target = Path(output)
    parent = safefile.folder_of(target)
    names = (target.name, fingerprint_path(target.name).name)
    for orphan in parent.glob(f".{glob.escape(target.name)}.*"):
        if not any(safefile.is_temporary_of(orphan.name, name) for name in names):
            continue
        if orphan.is_symlink() or not orphan.is_file():
            continue
        try:
            orphan.unlink()
        except OSError:
            pass
