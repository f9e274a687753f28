"""The prefix store: prefilled prefix caches kept on disk across runs (safetensors, no pickle).

One file per prefix, `<key>.safetensors`, named by a fingerprint of everything that changes the
tensors: the model's identity, dtype, device type, torch and transformers versions and the prefix
token ids. The file's header carries a sha256 of the tensor bytes and an HMAC of that digest and the
header, keyed by a secret only the user can read (`.store-key`, 0600, in a 0700 folder): a file
that fails to load or to verify (torn, or written by someone else, or claiming another prefix's
key) is reported, deleted and rebuilt. Files are written aside and renamed into place, so
concurrent writers cannot leave a torn file. The store is bounded: least recently used files go
first (a hit touches the file's modification time).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from .. import safefile
from ..errors import OutputError
from .cache import checks_dir, models_dir, prefixes_dir, states_dir
from .load import remove_stale_conversions
from .private import ForeignCache, cache_secret, owned, signed_by

log = logging.getLogger(__name__)

# What reading a damaged, truncated or foreign file raises: the file is then unusable, never an error.
UNREADABLE = (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError)
FORMAT = "prefixcache-prefix-3"  # 3: a GGUF file's first low-precision run no longer rounds its rotary frequencies
DEFAULT_MAX_BYTES = 2 * 1024**3
STALE_SECONDS = 3600  # a temporary file this old belongs to a writer that is gone


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    size: int
    last_used: float
    model: str
    prefix_tokens: int
    prefill_ms: float


def prefix_key(model_identity: str, engine: str, version: str, dtype: Any, device_type: str,
               prefix_ids: Sequence[int]) -> str:
    """The store's name for a prefix: everything that changes what is kept (the engine and its
    version among them: each keeps its own layout)."""
    import transformers

    parts = {
        "format": FORMAT, "model": model_identity, "engine": engine, "engine_version": version, "dtype": str(dtype),
        "device": device_type, "torch": torch.__version__, "transformers": transformers.__version__,
        "ids": list(prefix_ids),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _signature(secret: bytes, meta: dict[str, str]) -> str:
    """HMAC-SHA256 over the header (tensor digest included), in a fixed order."""
    text = json.dumps({k: v for k, v in meta.items() if k != "hmac"}, sort_keys=True)
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _kept(prefix: Any, engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What a prefix is kept as: the arrays and header its engine exports, the header naming the engine."""
    arrays, meta = engine.export_prefix(prefix)
    tensors = {name: a if isinstance(a, torch.Tensor) else torch.from_numpy(a) for name, a in arrays.items()}
    return tensors, {**meta, "engine": engine.name}


def _restored(meta: dict[str, str], tensors: dict[str, torch.Tensor], engine: Any, load_ms: float) -> Any:
    """A kept prefix back as its engine's; ValueError when another engine kept it or it is not whole."""
    if meta.get("engine") != engine.name:
        raise ValueError(f"a prefix the {meta.get('engine', 'unknown')} engine kept, asked for by {engine.name}")
    return engine.restore_prefix(tuple(json.loads(meta["ids"])), tensors, meta, load_ms)


class PrefixStore:
    """Example:
        store = PrefixStore(prefixes_dir(cache_dir))
        prefix = store.load(key, device) or store.save(key, engine.prefill(ids), model="...")
    """

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES):
        self.root, self.max_bytes = Path(root), max_bytes
        self._secret: bytes | None = None

    def _key(self) -> bytes:
        """The store's secret (model/private.py); ForeignCache for another user's store."""
        if self._secret is None:
            self._secret = cache_secret(self.root)
        return self._secret

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        """Whether a prefix is stored under `key` (read by `load` unless it proves unusable)."""
        return self._path(key).is_file()

    def load(self, key: str, engine: Any) -> Any:
        """The stored prefix, verified, restored by `engine` (model/protocol.py); None when absent
        or unusable (then removed)."""
        path = self._path(key)
        if not path.exists():
            return None
        start = time.perf_counter()
        try:
            self._key()
        except OSError as exc:  # another user's store: nothing in it is trusted, nothing removed
            log.warning("prefix store: %s; computing the prefix", exc)
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            if meta.get("format") != FORMAT or meta.get("key") != key or _digest(tensors) != meta.get("sha256"):
                raise ValueError("checksum or header mismatch")
            if not self._signed(meta):
                raise ValueError("not signed by this store")
            prefix = _restored(meta, tensors, engine, (time.perf_counter() - start) * 1000)
        except UNREADABLE as exc:  # a torn, truncated or foreign file: rebuild it
            log.warning("prefix store: %s is unusable (%s); computing the prefix again", path.name, exc)
            try:
                path.unlink(missing_ok=True)
            except OSError:  # a read-only cache: it stays, unused
                pass
            return None
        try:
            os.utime(path)  # last used
        except OSError as exc:  # a read-only cache: the prefix is used all the same
            log.warning("prefix store: cannot mark %s as used (%s); the store may evict it first", path.name,
                        exc.strerror or exc)
        self.remove_stale()  # a run that only loads still sweeps what killed writers left
        return prefix

    def save(self, key: str, prefix: Any, model: str, engine: Any) -> Any:
        """Write `prefix` atomically, as `engine` exports it; returns it. Failure to write is a
        warning, not an error."""
        tensors, meta = _kept(prefix, engine)
        meta.update({"format": FORMAT, "key": key, "model": model, "ids": json.dumps(list(prefix.ids)),
                     "prefill_ms": f"{prefix.prefill_ms:.3f}", "sha256": _digest(tensors)})
        try:
            meta["hmac"] = _signature(self._key(), meta)
            safefile.replace(self._path(key), save(tensors, metadata=meta), what="the stored prefix", mode=0o600)
            self.evict(keep=key)
        except (OSError, OutputError, SafetensorError) as exc:  # a full disk, a read-only or foreign cache
            log.warning("prefix store: cannot write %s (%s); continuing without it", self.root,
                        getattr(exc, "strerror", None) or exc)
        return prefix

    def entries(self) -> list[Entry]:
        out = []
        for path in sorted(self.root.glob("*.safetensors")) if self.root.is_dir() else ():
            if path.name.startswith(".tmp-"):
                continue  # another process is writing it
            try:
                st = path.stat()
                try:
                    with safe_open(str(path), framework="pt") as f:
                        meta = f.metadata() or {}
                    model, tokens = meta.get("model", "?"), len(json.loads(meta.get("ids", "[]")))
                    prefill_ms = float(meta.get("prefill_ms", 0))
                except UNREADABLE:
                    model, tokens, prefill_ms = "(unreadable)", 0, 0.0
                out.append(Entry(path.stem, path, st.st_size, st.st_mtime, model, tokens, prefill_ms))
            except FileNotFoundError:
                continue  # removed meanwhile
        return out

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used entries until the store fits in `max_bytes` (and the temporary
        files of writers killed mid-write, once they are an hour old)."""
        self.remove_stale()
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total = sum(e.size for e in entries)
        removed = []
        for e in entries:
            if total <= self.max_bytes:
                break
            if e.key == keep:
                continue
            e.path.unlink(missing_ok=True)
            total -= e.size
            removed.append(e.key)
        return removed

    def remove_stale(self, age: float = STALE_SECONDS) -> None:
        """Remove the temporary files of writers killed mid-write, once `age` seconds old."""
        for tmp in self.root.glob(".*") if self.root.is_dir() else ():
            if not (tmp.name.startswith(".tmp") or tmp.name.endswith(safefile.TEMP_SUFFIX)):
                continue
            try:
                if time.time() - tmp.stat().st_mtime >= age and tmp.is_file() and not tmp.is_symlink():
                    tmp.unlink()
            except OSError:
                pass  # another process is finishing or removing it

    def clear(self) -> int:
        """Remove every stored prefix this store signed (and temporary files writers left); a file
        it did not sign is not its to remove. Returns how many prefixes."""
        entries = [e for e in self.entries() if self.signed(e.path)]
        for e in entries:
            e.path.unlink(missing_ok=True)
        self.remove_stale(age=0)
        return len(entries)

    def signed(self, path: Path) -> bool:
        """Whether the file's header is signed by this store (its tensors are not read)."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            return self._signed(meta)
        except UNREADABLE:  # unreadable, or not a safetensors file at all
            return False

    def _signed(self, meta: dict[str, str]) -> bool:
        return hmac.compare_digest(meta.get("hmac", ""), _signature(self._key(), meta))


def describe(entry: Entry) -> dict[str, Any]:
    return {
        "fingerprint": entry.key, "model": entry.model, "prefix_tokens": entry.prefix_tokens,
        "size_mb": round(entry.size / 2**20, 2), "last_used": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.last_used)),
    }


def clear_cache(cache_dir: Path, models: bool = False) -> tuple[int, bool]:
    """Remove the stored prefixes under `cache_dir` (and with `models` the converted models).
    Returns (prefixes removed, whether converted models were removed)."""
    try:
        if Path(cache_dir).exists():
            owned(Path(cache_dir))  # never another user's files
        store = PrefixStore(prefixes_dir(cache_dir))
        removed = store.clear() if store.root.is_dir() else 0
        if states_dir(cache_dir).is_dir():  # what fit kept: derived data, cleared with the prefixes
            shutil.rmtree(states_dir(cache_dir))
        bounds = checks_dir(cache_dir) / "exact-bounds"
        if bounds.is_dir():  # what --exact measured of a model's precision: derived too
            shutil.rmtree(bounds)
        gone = models and models_dir(cache_dir).is_dir()
        if gone:
            _clear_models(models_dir(cache_dir), store._key())
    except ForeignCache as exc:
        raise OutputError(f"cannot clear the cache: {exc}")
    except OSError as exc:
        raise OutputError(f"{exc.filename or cache_dir}: cannot remove it: {exc.strerror}")
    return removed, gone


def _clear_models(folder: Path, secret: bytes) -> None:
    """Remove the converted models (folders whose record this cache signed) and conversions
    killed mid-write (`.tmp-*` folders of the user's); anything else in the folder is not
    prefixcache's and stays."""
    remove_stale_conversions(folder, age=0)
    for entry in folder.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue
        if signed_by(entry, secret):
            shutil.rmtree(entry)
    try:
        folder.rmdir()  # only when nothing else is left
    except OSError:
        pass
