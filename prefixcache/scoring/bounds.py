"""The gap bounds `--exact` measured, kept so a task is measured once: by the model, the engine
and its version at the precision, the device kind and the task's prompt and decision rules.

A bound is a number the records depend on (which items are scored again in float32), so it is
read only from the user's own cache folder: a file another user could plant is never trusted.
A bound that cannot be kept (a read-only or foreign cache) is measured again next time, on the
same items, to the same value.

Example:
    store = BoundStore(cache_dir)
    key = bound_key(task, engine, "bfloat16")
    bound = store.get(key)            # None: not measured yet
    store.put(key, 0.043, items=32)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import safefile
from ..errors import OutputError
from ..model.cache import checks_dir
from ..model.private import ForeignCache, private_folder

if TYPE_CHECKING:
    from .prepare import Task

log = logging.getLogger(__name__)
FORMAT = 1


def engine_parts(engine: Any, precision: str) -> dict[str, str]:
    """What of an engine its numbers depend on: its name, its version at `precision`, the
    precision and the device kind."""
    from ..model.engines import backend_named

    return {"engine": engine.name, "version": backend_named(engine.name).version(precision), "precision": precision,
            "device": str(engine.device).split(":")[0]}


def answering(task: "Task", engine: Any, precision: str, head: bool = True) -> dict[str, Any]:
    """What a task's answers depend on: the model's weights, the engine (`engine_parts`), the
    prompt's prefix and every rule of the spec that turns scores into decisions (labels,
    normalisation, calibration, thresholds, questions; its head unless `head` is false). A kept
    bound's key (`bound_key`) and a Ray checkpoint's fingerprint (raycheckpoint.py) are made of it."""
    from ..model.load import model_identity

    spec = dataclasses.replace(task.spec, path="", digest=None, gold=None)
    if not head:
        spec = dataclasses.replace(spec, head=None)
    return {"model": model_identity(task.source), **engine_parts(engine, precision),
            "prefix": list(task.builder.prefix_ids), "spec": repr(spec)}


def bound_key(task: "Task", engine: Any, precision: str) -> str:
    """What a measured bound depends on (`answering`), as a key."""
    parts = {"format": FORMAT, **answering(task, engine, precision)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


class BoundStore:
    """Measured bounds under the cache's `checks/exact-bounds` folder, one small file each."""

    def __init__(self, cache_dir: Path):
        self.folder = checks_dir(cache_dir) / "exact-bounds"

    def _usable(self) -> bool:
        try:
            private_folder(self.folder.parent.parent, tighten=False)
            private_folder(self.folder.parent, tighten=False)
            private_folder(self.folder)
            return True
        except (ForeignCache, OSError) as exc:
            log.debug("exact bounds not kept in %s: %s", self.folder, exc)
            return False

    def get(self, key: str) -> float | None:
        """The bound kept under `key`, or None (none kept, or one that cannot be read as one)."""
        path = self.folder / f"{key}.json"
        if not path.is_file() or not self._usable():
            return None
        try:
            bound = json.loads(path.read_text(encoding="utf-8")).get("bound")
        except (OSError, ValueError, AttributeError):
            return None
        return float(bound) if isinstance(bound, (int, float)) and math.isfinite(bound) and bound > 0 else None

    def put(self, key: str, bound: float, items: int, widest: float) -> None:
        """Keep a measured bound (and what it was measured on, for the curious); a cache that cannot
        take it only costs the next run the same measurement."""
        if not self._usable():
            return
        text = json.dumps({"bound": bound, "items": items, "widest_shift": widest}) + "\n"
        try:
            safefile.replace(self.folder / f"{key}.json", text, "an --exact bound")
        except (OSError, OutputError) as exc:  # a full disk, a read-only cache: measured again next time
            log.debug("cannot keep the --exact bound: %s", exc)
