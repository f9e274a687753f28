"""The reader of labelled files: every item checked against every spec (its fields, its options,
its gold) before any model loads. What `tune`, `fit` and `suggest` read their labelled items with.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..data.items import Item, detect_format, read_items, scan_items
from ..errors import InputError
from ..task.spec import TaskSpec
from .options import RunOptions


def labelled_items(path: str, o: RunOptions, specs: list[TaskSpec],
                   stdin: str = "tune reads its labelled items from a file (it scores them once per variant)"
                   ) -> list[Item]:
    """A file's items, every one checked against every spec (fields, options, gold)."""
    if path == "-":
        raise InputError(f"{stdin}, not stdin")
    fmt = detect_format(path, o.input_format)

    def check(record: Mapping[str, Any]) -> None:
        for spec in specs:
            spec.check_record(record)

    spec = specs[0]
    total = scan_items(path, fmt, spec.id_field, check, spec.id_field_given, None, o.delimiter, o.encoding)
    items = read_items(path, fmt, spec.id_field, o.delimiter, o.encoding)
    return [item for n, item in zip(range(min(total, o.limit or total)), items)]
