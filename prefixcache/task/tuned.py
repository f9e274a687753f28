"""The tuned spec: the spec file as the user wrote it, with the chosen keys set. Keys it does not
change keep their lines and comments; a changed key's line says what it was (with its old
comment, which may describe the old value); keys the file lacks are added at the end. No torch.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from .. import safefile
from ..errors import OutputError, SpecError
from .keys import spec_from_mapping
from .specfile import spec_text_data, SpecFile

log = logging.getLogger("prefixcache")
_KEY = re.compile(r"^([A-Za-z_][\w-]*)\s*:(.*)$")


def check_tuned_output(path: Path | None, spec: Path, overwrite: bool) -> None:
    """Refuse, before any scoring, a tuned spec that cannot be written or would replace a file."""
    if path is None:
        return
    safefile.check_target(path)
    if path.exists() and spec.exists() and path.samefile(spec):
        raise OutputError(f"{path}: is the spec itself; write the tuned spec to another file")
    if path.exists() and not overwrite:
        raise OutputError(f"{path}: already exists; use --overwrite to replace it")


def tuned_text(original: str, keys: Mapping[str, Any], header: str = "", by: str = "tune") -> str:
    """The spec's text with `keys` set (each to a YAML value), `header` as comment lines on top."""
    lines = original.splitlines()
    starts = [(n, m.group(1)) for n, line in enumerate(lines) if (m := _KEY.match(line))]
    for key, value in keys.items():
        found = [(n, k) for n, k in starts if k == key]
        if not found:
            continue
        first = found[0][0]
        after = [n for n, _ in starts if n > first]
        end = after[0] if after else len(lines)
        while end > first + 1 and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
            end -= 1  # blank lines and comments before the next key are the next key's
        if _value(lines[first:end], key) == value:
            continue
        new = _dumped(key, value, lines[first] if end == first + 1 else None, replaced=True)
        lines[first:end] = new
        shift = len(new) - (end - first)
        starts = [(n + shift if n > first else n, k) for n, k in starts]
    missing = [key for key in keys if not any(k == key for _, k in starts)]
    if missing:
        lines += ["", f"# chosen by prefixcache {by}"] + [line for key in missing for line in _dumped(key, keys[key])]
    top = [f"# {line}" if line else "#" for line in header.splitlines()]
    return "\n".join(top + lines) + "\n"


def _value(block: list[str], key: str) -> Any:
    """The value a key's lines hold (a sentinel when they cannot be read alone)."""
    try:
        return (yaml.safe_load("\n".join(block)) or {}).get(key, _UNREAD)
    except (yaml.YAMLError, AttributeError):
        return _UNREAD


_UNREAD = object()


def _dumped(key: str, value: Any, old_line: str | None = None, replaced: bool = False) -> list[str]:
    """`key: value` as YAML lines. Replacing a one-line value by another, the line says what it
    was, with the old line's comment (which may describe the old value): `normalize: sum  #
    tuned, was: mean  # per token`; a longer value replaced gets a comment line above it."""
    text = yaml.safe_dump({key: value}, sort_keys=False, allow_unicode=True, default_flow_style=False, width=10**6)
    new = text.rstrip("\n").splitlines()
    if not replaced:
        return new
    if old_line is not None and len(new) == 1:
        was = _KEY.match(old_line)
        if was is not None:
            return [f"{new[0]}  # tuned, was:{was.group(2)}"]
    return ["# set by prefixcache tune", *new]


def relocated(raw: Mapping[str, Any], spec_path: Path, output: Path) -> dict[str, Any]:
    """What must change for the spec to mean the same from another folder: a model path relative
    to the spec's folder, made absolute."""
    model = raw.get("model")
    if not isinstance(model, str) or Path(model).expanduser().is_absolute() or Path(model).exists():
        return {}
    beside = spec_path.parent / model
    if not beside.exists() or spec_path.parent.resolve() == (output.parent if str(output.parent) else Path(".")).resolve():
        return {}
    return {"model": str(beside.resolve())}


def write_tuned(path: Path, spec_file: SpecFile, keys: Mapping[str, Any], header: str, by: str = "tune") -> None:
    """Write the tuned spec: the spec file's text with `keys` set. Should an edit read back other
    than meant (a layout the line editor does not follow), the whole mapping is written instead,
    without the comments."""
    wanted = {**spec_file.data, **keys}
    text = tuned_text(spec_file.text, keys, header, by)
    if not _reads_back(text, wanted, spec_file.path):
        log.warning("%s: could not keep the spec's layout; writing its keys without the comments", path)
        text = tuned_text("", {}, header) + yaml.safe_dump(dict(wanted), sort_keys=False, allow_unicode=True, width=10**6)
    if not _reads_back(text, wanted, spec_file.path):  # a character YAML reads as another (U+0085): escape them
        text = tuned_text("", {}, header) + yaml.safe_dump(dict(wanted), sort_keys=False, allow_unicode=False, width=10**6)
    if not _reads_back(text, wanted, spec_file.path):
        raise OutputError(f"{path}: the tuned spec would not read back as the spec that was scored; not written")
    spec_from_mapping(spec_text_data(text, path), path)  # it is a valid spec where it is written, or this is a bug
    safefile.replace(path, text, what="the tuned spec")


def _reads_back(text: str, wanted: Mapping[str, Any], path: Path) -> bool:
    """`text`, read as `run` reads a spec (a key given twice refused), holds `wanted`."""
    try:
        return spec_text_data(text, path) == wanted
    except SpecError:
        return False
