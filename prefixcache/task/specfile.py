"""The spec file: strict YAML read (aliases and keys given twice refused), the file's text and
digest kept (`SpecFile`), and `load_spec`. No torch here."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..errors import SpecError
from .keys import spec_from_mapping
from .spec import ITEM_EXTENSIONS, TaskSpec

class _RefusedYAML(Exception):
    def __init__(self, mark: Any, message: str):
        super().__init__(message)
        self.line, self.message = (mark.line + 1 if mark else "?"), message


class _SpecLoader(yaml.SafeLoader):
    """yaml.safe_load, minus what a spec never needs and an attacker can use: aliases (a few lines
    of them expand to gigabytes) and keys given twice (the second silently wins)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _RefusedYAML(event.start_mark, f"YAML alias *{event.anchor} is not allowed in a spec; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _RefusedYAML(key_node.start_mark, f"key {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_text(path: Path, what: str) -> tuple[str, str]:
    """A file's text and the sha256 of its bytes (read once: the file may be a pipe)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecError(f"{path}: {what} file not found")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read {what}: {exc.strerror}")
    try:
        return data.decode("utf-8"), hashlib.sha256(data).hexdigest()
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.start})")


def load_yaml(path: Path, what: str = "spec") -> Any:
    """A YAML file read as specs are (no aliases, no key given twice); `what` names it in errors."""
    return _parse_yaml(_read_text(path, what)[0], path)


def spec_text_data(raw: str, path: str | Path = "<spec>") -> Any:
    """What a spec's text holds, read exactly as `run` reads a spec file (SpecError otherwise)."""
    return _parse_yaml(raw, Path(path))


def _parse_yaml(raw: str, path: Path) -> Any:
    try:
        return yaml.load(raw, Loader=_SpecLoader)
    except _RefusedYAML as exc:
        raise SpecError(f"{path}:{exc.line}: {exc.message}")
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        hint = ""
        problem = str(exc.problem or "")
        if "flow" in str(exc.context or "") and ("'?'" in problem or "':'" in problem):  # {instructions: Which team?}
            hint = ("; inside { } or [ ], quote text that holds ? : , # [ ] { }, e.g. "
                    "{instructions: \"Which team?\"}, or write the mapping on its own lines")
        raise SpecError(f"{loc}: YAML syntax error: {exc.problem or exc.context}{hint}")
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: YAML error: {exc}")
    except RecursionError:
        raise SpecError(f"{path}: YAML nested too deeply")


def load_spec(path: str | Path, **keys: Any) -> TaskSpec:
    """Read and validate a task spec, with `keys` set over the file's. Raises `SpecError` naming
    the file and the key. The spec's `digest` is that of the bytes read (a spec from a pipe too)."""
    return read_spec_file(path).spec(**keys)


@dataclass(frozen=True)
class SpecFile:
    """A spec file as read, once (it may be a pipe): its text, its keys as YAML reads them (not
    validated yet) and the sha256 of its bytes."""

    path: Path
    text: str
    data: Mapping[str, Any]
    digest: str

    def spec(self, **keys: Any) -> TaskSpec:
        """The validated spec, with `keys` set over the file's."""
        return dataclasses.replace(spec_from_mapping({**self.data, **keys}, self.path), digest=self.digest)


def read_spec_file(path: str | Path) -> SpecFile:
    path = Path(path)
    suffix = Path(path.stem).suffix.lower() if path.suffix.lower() == ".gz" else path.suffix.lower()
    if suffix in ITEM_EXTENSIONS:
        raise SpecError(f"{path}: is an items file, not a spec; the spec comes first: prefixcache run SPEC ITEMS")
    raw, digest = _read_text(path, "spec")
    data = _parse_yaml(raw, path)
    if not isinstance(data, Mapping):
        raise SpecError(f"{path}: a spec is a YAML mapping of keys (model, system, labels, ...)")
    return SpecFile(path, raw, data, digest)


