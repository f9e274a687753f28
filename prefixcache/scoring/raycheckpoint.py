"""A Ray Data job resumed from Ray's row-level checkpoint answers as the job it continues.

Ray Data (2.5x) can keep a checkpoint of the rows a job has written
(`DataContext.checkpoint_config`, `CheckpointConfig(id_column, checkpoint_path)`): run again after a
failure, the job skips the rows it finds there. Nothing in Ray asks whether the job that wrote them
scored with the same spec, model, engine and precision: a job resumed after one changed would
write the rest of its rows with another classifier beside the first, as `run --resume` refuses to.

So each prefixcache actor (`prefixcache.ray.Classify`, `Decide`), as it starts, keeps the
fingerprint of what answers (`FILE`, in the checkpoint folder) and compares it with the one kept
there: while the folder holds checkpointed rows, another fingerprint is refused in one line
naming what changed, and the job fails before any row is scored. A folder holding no rows (a new
job, or one whose checkpoint Ray deleted on success) takes the new fingerprint. This module does
not import Ray until an actor asks.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

from ..errors import UsageError

FILE = "prefixcache.fingerprint.json"
WHAT = {"spec": "spec", "prefix": "prompt", "model": "model", "engine": "engine", "version": "engine version",
        "device": "device kind", "precision": "precision", "exact": "--exact", "prune": "pruning", "head": "head",
        "heads": "served heads"}


def task_fingerprint(task: Any, engine: Any, precision: str, **more: Any) -> dict[str, Any]:
    """What a row's answer depends on (bounds.py: `answering`, the prompt and the spec's rules as
    digests), its head by its digest (not its path), and `more`: the options that change
    answers, such as exact or pruning."""
    from .bounds import answering

    parts = answering(task, engine, precision, head=False)
    parts.update(spec=_digest(parts["spec"]), prefix=_digest(json.dumps(parts["prefix"])))
    return {**parts, **({"head": task.spec.head.digest} if task.spec.head is not None else {}), **more}


def check_resumed_job(fingerprint: Mapping[str, Any]) -> None:
    """In an actor of a Ray Data job with a checkpoint: refuse (UsageError) to continue a
    checkpoint written by a job whose fingerprint differs; keep this one's otherwise. Without Ray
    Data or without a checkpoint, nothing."""
    try:
        from ray.data import DataContext
    except ImportError:
        return
    config = getattr(DataContext.get_current(), "checkpoint_config", None)
    root = getattr(config, "checkpoint_path", None) if config is not None else None
    if not root:
        return
    fs, folder = _filesystem(str(root), getattr(config, "override_filesystem", None))
    path = f"{folder.rstrip('/')}/{FILE}"
    kept = _read(fs, path)
    mine = json.loads(json.dumps(dict(fingerprint), sort_keys=True, default=str))
    if kept == mine:
        return
    if kept is not None and _holds_rows(fs, folder):
        changed = [WHAT.get(k, k) for k in sorted(set(kept) | set(mine)) if kept.get(k) != mine.get(k)]
        named = ", ".join(changed[:-1]) + (" and " if len(changed) > 1 else "") + changed[-1]
        raise UsageError(f"Ray Data's checkpoint {root} holds rows of a job with another {named}: "
                         f"resumed, this job would write the rest with another classifier beside them; run it with "
                         f"what the checkpoint's job had, or start it anew (a new checkpoint_path and output)")
    fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(json.dumps(mine, indent=2, sort_keys=True).encode() + b"\n")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _filesystem(root: str, given: Any) -> tuple[Any, str]:
    """The pyarrow filesystem and path of the checkpoint folder, as Ray reads it."""
    import pyarrow.fs

    if given is not None:
        return given, root
    if "://" in root:
        return pyarrow.fs.FileSystem.from_uri(root)
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(root)


def _read(fs: Any, path: str) -> dict[str, Any] | None:
    import pyarrow.fs

    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        try:
            found = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None
    return found if isinstance(found, dict) else None


def _holds_rows(fs: Any, folder: str) -> bool:
    """Whether Ray's checkpoint folder holds anything but the fingerprint (rows written)."""
    import pyarrow.fs

    found = fs.get_file_info(pyarrow.fs.FileSelector(folder, recursive=True, allow_not_found=True))
    return any(info.type == pyarrow.fs.FileType.File and not info.path.endswith("/" + FILE) for info in found)
