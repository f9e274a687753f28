"""The cache is the user's alone: its folders, the secret that signs what is kept there, and the
signatures of converted models.

Folders are created 0700 whatever the umask, and a folder or key another user owns is never
trusted: anything in it could have been written by them (`ForeignCache`). The secret
(`.store-key`, 0600) signs stored prefixes and converted models; a converted model's signature
covers a sha256 of each of its files, so weights swapped or damaged after conversion are never
used. Checking the sha256 of gigabytes on every load would cost seconds, so the signature also
covers each file's size, inode, modification and change times: while those hold (nobody but the
user can write the folder, and a change time cannot be set back) the files are the ones hashed;
when they differ (a copy, a restore from backup) the files are hashed again and compared.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from ..errors import OutputError
from ..safefile import create_once, replace

KEY_NAME = ".store-key"
SIGNED = "prefixcache.json"  # a converted model's record: its source and its files' digests, signed


class ForeignCache(OSError):
    """A cache folder or key that another user owns (or others may write): not used."""


def private_folder(path: Path, tighten: bool = True) -> None:
    """Create `path` and each missing folder above it readable and writable by the user alone,
    whatever the umask; with `tighten`, also an existing `path` of the user's that others could
    read or write (a folder prefixcache owns, never one the user named for it). Raises
    ForeignCache when `path` belongs to another user."""
    path = Path(path)
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    if missing:
        _safe_to_create_in(path)
    unswappable(path if missing else path.parent)  # before anything is made: nothing under a folder others can change
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first
            pass
        os.chmod(folder, 0o700)  # mkdir's mode is cut by the umask only to fewer rights; say it outright
    target = missing[0] if missing else path
    owned(target)
    st = target.stat()
    if tighten and st.st_mode & 0o077:
        os.chmod(target, 0o700)


def unswappable(folder: Path) -> None:
    """Raise ForeignCache unless no other user can rename, replace or relink `folder` or any
    folder above it: each is the user's or root's, and none is writable by others (nor by a group
    not the user's own) unless sticky, like /tmp. Checked on the path as written (its links
    included) and on the path they lead to. A cache under such a folder is loaded by path after
    it is checked, so nothing between the check and the load can swap it."""
    written = Path(os.path.abspath(folder))
    for chain, look in ((written, os.lstat), (written.resolve(), os.stat)):
        for step in [*reversed(chain.parents), chain]:
            st = look(step)
            if st.st_uid not in (os.getuid(), 0):
                raise ForeignCache(f"{step} belongs to uid {st.st_uid}, so a cache under it is not trusted: "
                                   f"keep the cache in a folder of your own (--cache-dir)")
            if stat.S_ISLNK(st.st_mode) or st.st_mode & stat.S_ISVTX:
                continue
            if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getgid()):
                raise ForeignCache(f"{step} may be changed by other users (mode {stat.S_IMODE(st.st_mode):o}), so a "
                                   f"cache under it could be swapped under a run: keep the cache in a folder only you "
                                   f"can write (--cache-dir)")


def _safe_to_create_in(folder: Path) -> None:
    """A folder the cache may be created in: the user's own, or root's that no one else may
    change (not writable by others, or sticky like /tmp). Raises ForeignCache otherwise."""
    st = os.stat(folder)
    if st.st_uid == os.getuid():
        return
    if st.st_uid == 0 and (not st.st_mode & 0o022 or st.st_mode & stat.S_ISVTX):
        return
    raise ForeignCache(f"{folder} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): no cache is made in it")


def owned(path: Path) -> None:
    """Raise ForeignCache unless the running user owns `path`."""
    st = os.lstat(path)
    if st.st_uid != os.getuid():
        raise ForeignCache(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): not used")


def cache_secret(root: Path) -> bytes:
    """The secret under `root` (made once, exclusively, 0600; read after). Raises ForeignCache for
    a folder or key another user owns or others may read."""
    private_folder(root)
    path = root / KEY_NAME
    if not path.exists():  # written whole, then linked in: a racing writer sees all of it or none
        create_once(path, secrets.token_bytes(32), 0o600)
    if path.is_symlink():
        raise ForeignCache(f"{path} is a symbolic link: not used")
    owned(path)
    if path.stat().st_mode & 0o077:
        raise ForeignCache(f"{path} is readable or writable by others: not used")
    return path.read_bytes()


def sign(secret: bytes, data: Any) -> str:
    """HMAC-SHA256 of `data` as canonical JSON."""
    return hmac.new(secret, json.dumps(data, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def sign_folder(folder: Path, secret: bytes, source: str, created: float) -> None:
    """Write `folder`'s signed record: each file's sha256 and stat, under `secret`."""
    files = {p.name: {"sha256": _sha256(p)} for p in sorted(folder.iterdir()) if p.is_file() and p.name != SIGNED}
    record = {"source": source, "created": created, "files": files}
    record["hmac"] = sign(secret, {"source": source, "files": files})
    record["stat"] = sign(secret, _stats(folder, files))
    replace(folder / SIGNED, json.dumps(record), what="the converted model's record", mode=0o600)


def _record(folder: Path) -> dict | None:
    """`folder`'s record (its source and files), or None when it has none that reads as one."""
    try:
        record = json.loads((folder / SIGNED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and {"files", "source"} <= record.keys() else None


def _signed(record: dict, secret: bytes) -> bool:
    expected = sign(secret, {"source": record["source"], "files": record["files"]})
    return hmac.compare_digest(str(record.get("hmac", "")), expected)


def signed_by(folder: Path, secret: bytes) -> bool:
    """Whether `folder` holds a record signed with `secret`: prefixcache made it, in this cache."""
    record = _record(folder)
    return record is not None and _signed(record, secret)


def verify_folder(folder: Path, secret: bytes, source: str | None = None) -> str | None:
    """Why `folder`'s files are not the ones signed (or, given `source`, not converted from that
    file), or None when they are (see the module)."""
    record = _record(folder)
    if record is None:
        return "it has no signed record of its files (converted by an older version?)"
    files, made_from = record["files"], record["source"]
    if not _signed(record, secret):
        return "its record is not signed by this cache"
    if source is not None and os.path.realpath(str(made_from)) != os.path.realpath(source):
        return f"it was converted from {made_from}, not from {source} (moved or restored into another's place?)"
    present = {p.name for p in folder.iterdir() if p.is_file() and p.name != SIGNED}
    if present != set(files):
        return f"its files are not the ones converted ({', '.join(sorted(present ^ set(files))[:3])})"
    if hmac.compare_digest(str(record.get("stat", "")), sign(secret, _stats(folder, files))):
        return None
    for name, info in files.items():
        if _sha256(folder / name) != info.get("sha256"):
            return f"{name} is not the file converted"
    record["stat"] = sign(secret, _stats(folder, files))  # the same bytes, copied or restored: trust them again
    try:
        replace(folder / SIGNED, json.dumps(record), what="the converted model's record", mode=0o600)
    except OutputError:  # a read-only cache: checked again next time
        pass
    return None


def _stats(folder: Path, files: dict) -> list:
    out = []
    for name in sorted(files):
        st = os.lstat(folder / name)
        out.append([name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns])
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
