"""A fitted readout (`head:` in a spec): per question, a logistic regression on views of the
model's forward (the state at the question's answer position, of the final or a middle layer, and
the mean over the item's tokens: task/features.py), read from a safetensors file and checked
before any model loads. No torch here.

The file holds, per question `i`, float arrays `{i}.mean`, `{i}.scale` ([U, D]: the standardisation),
`{i}.coef` ([K, D]) and `{i}.intercept` ([K]), and in its metadata (`prefixcache_head`, JSON) the
questions (id, options, whether each option is its own yes/no head), which features it reads, and
the fingerprint of what it was fitted on: the model, the prompt prefix's token ids, the item's
prompt around its fields, and the questions. A question of one of several options has one unit
(U = 1) whose features are its views where its first option token is scored (and, when it says so,
its options' prompt log-probabilities): probabilities are softmax(coef z + intercept) over its K
options. A multi-label spec's labels are each their own yes/no head (U = K), each reading the state
where its own yes/no is scored: P(on) = sigmoid(coef[k] z[k] + intercept[k]).

A head is data, never code: nothing is unpickled; every array is checked for shape and finiteness.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import SpecError
from .decision import Decision, Tags, ranked
from .familiar import Familiar
from .reliability import Reliability
from .features import Features, views_of

FORMAT = "prefixcache-head"
VERSION = 3  # 3: a readout may keep its fitted rows' states in brief (task/familiar.py); 2: middle layers, means
READS = (1, 2, 3)
FAMILIAR = ("center", "scale", "basis", "spread")  # a readout's familiarity arrays: {i}.familiar.<name>
META_KEY = "prefixcache_head"
MAX_BYTES = 1 << 30  # a head of 150 options on a 4096-wide state is ~5 MB; far larger is not one
FINGERPRINT_PARTS = {  # part -> what to say when it differs; the most specific first (labels and the
    "model": "model",  # template change the prefix too: the labels are listed in the system text, and the
    "questions": "label set or questions",  # template's text before its first field is part of the prefix)
    "template": "item prompt (template, answer prefix or chat template)",
    "prefix": "prompt prefix (system text, examples or chat template)",
}


@dataclass(frozen=True)
class Readout:
    """One question's head. `binary`: each option is its own yes/no head (tags)."""

    qid: str
    options: tuple[str, ...]
    binary: bool
    features: str  # a feature set (task/features.py): "state", "state+logprobs", "state+mean", ...
    mean: np.ndarray  # [U, D]
    scale: np.ndarray  # [U, D]
    coef: np.ndarray  # [K, D]
    intercept: np.ndarray  # [K]
    cuts: Mapping[str, float] = field(default_factory=dict)  # one of several: an option's own abstention cut
    familiar: Familiar | None = None  # the fitted rows' states in brief: how far an item lies from them
    reliability: Reliability | None = None  # one of several: how often held-out answers were right, by probability

    def novelty(self, views: Mapping[str, np.ndarray]) -> float | None:
        """How far the item lies from the rows the readout was fitted on, in units of what 99% of
        them reach held out (task/familiar.py); None for a head fitted before it kept them."""
        if self.familiar is None:
            return None
        return self.familiar.novelty(self.reads.joined(views)[0])

    @property
    def units(self) -> int:
        """Answer positions read: one per option (binary), else one."""
        return len(self.options) if self.binary else 1

    @functools.cached_property
    def reads(self) -> Features:  # parsed once: every item asks it (its probabilities, its novelty)
        return Features.parse(self.features)

    @property
    def hidden(self) -> int:
        """The width of the state it reads (each view's)."""
        f = self.reads
        return (self.coef.shape[1] - (self._extra if f.logprobs else 0)) // len(f.views)

    @property
    def _extra(self) -> int:
        return 1 if self.binary else len(self.options)

    def probs(self, views: Mapping[str, np.ndarray], logprobs: Sequence[float] | None) -> list[float]:
        """The head's probabilities from the views it reads (each [U, H] float) and the options'
        prompt log-probabilities (K; None when it reads none): a distribution over the options, or
        per option P(on)."""
        f = self.reads
        x = f.joined(views).astype(np.float64)  # [U, len(views) * H]
        if f.logprobs:
            lp = np.asarray(logprobs, dtype=np.float64)
            x = np.concatenate([x, lp[:, None] if self.binary else lp[None, :]], axis=1)  # [U, D]
        z = (x - self.mean) / self.scale  # [U, D]
        if self.binary:
            logits = (self.coef * z).sum(axis=1) + self.intercept  # [K]
            return [float(v) for v in 1.0 / (1.0 + np.exp(-np.clip(logits, -700, 700)))]
        logits = self.coef @ z[0] + self.intercept  # [K]
        logits -= logits.max()
        e = np.exp(logits)
        return [float(v) for v in e / e.sum()]


@dataclass(frozen=True)
class Head:
    """A spec's fitted readouts, one per question, and what they were fitted on."""

    path: str
    readouts: tuple[Readout, ...]
    fingerprint: Mapping[str, str]
    layer: str  # which state: "final" (after the last norm, what the lm_head reads)
    digest: str  # sha256 of the file's bytes: a run's output is tied to it
    fitted: Mapping[str, Any]  # what fit says of itself (counts, chosen C), shown by `--dry-run`-like views

    def check(self, found: Mapping[str, str]) -> None:
        """Refuse, in one line, a head fitted on another model, prompt or label set."""
        for part, what in FINGERPRINT_PARTS.items():
            if self.fingerprint.get(part) != found.get(part):
                raise SpecError(f"{self.path}: this head was fitted with another {what} than the "
                                f"spec now has; it would decide from states it never saw: fit it again "
                                f"(prefixcache fit) or remove 'head' from the spec")

    def readout_for(self, qid: str) -> Readout | None:
        """The question's readout, or None (that question is answered by the prompt)."""
        return next((r for r in self.readouts if r.qid == qid), None)

    def reads(self, questions: Sequence[Any]) -> list[bool | None]:
        """Per question, what its readout reads: None (it has none), False (the state where its
        options start), True (each option judged yes/no: the state where each one's is scored)."""
        return [None if (r := self.readout_for(q.id)) is None else r.binary for q in questions]

    @property
    def views(self) -> tuple[str, ...]:
        """Every view its readouts read (task/features.py), each once."""
        return views_of([r.reads for r in self.readouts])

    def check_questions(self, questions: Sequence[Any]) -> None:
        """Refuse, in one line, a head whose header disagrees with the spec's questions: a readout
        of a question the spec does not ask, or whose options (names and order) or kind are not
        the question's (its labels were edited, or the header was)."""
        asked = {q.id: q for q in questions}
        for r in self.readouts:
            q = asked.get(r.qid)
            if q is None or tuple(q.options) != r.options or bool(q.kind.judged_each) != r.binary:
                theirs = f"answers {list(r.options)}" if q is not None else "is a question the spec does not ask"
                raise SpecError(f"{self.path}: this head was fitted with another label set or questions than the spec "
                                f"now has (its question {r.qid!r} {theirs}"
                                f"{f', the spec asks {list(q.options)}' if q is not None else ''}); it would answer "
                                f"with the wrong names: fit it again (prefixcache fit) or remove 'head' from the spec")

    def check_engine(self, name: str, precision: str) -> None:
        """Refuse a head fitted on states another engine, or the same in another precision, read
        (their states differ: two engines by up to 0.46 nats on one file's log-probs). Heads fitted
        before this was written down are taken as they are."""
        was = self.fitted.get("engine") if isinstance(self.fitted, Mapping) else None
        if not isinstance(was, Mapping) or (was.get("name"), was.get("precision")) == (name, precision):
            return
        backend = f"--backend {was.get('name')}"
        how = backend if was.get("name") != name else f"--dtype {was.get('precision')}"
        raise SpecError(f"{self.path}: this head was fitted on states {was.get('name')} read in {was.get('precision')}, "
                        f"and this run reads them with {name} in {precision}: run it with {how}, or fit it again on "
                        f"this engine")

    def check_width(self, hidden: int, layers: int) -> None:
        """Refuse a head whose state width is not the model's, or that reads a layer the model
        lacks or its engine cannot read (`layers`: the engine's readable decoder layers)."""
        if self.readouts and self.readouts[0].hidden != hidden:
            raise SpecError(f"{self.path}: this head reads states of width {self.readouts[0].hidden}, and the model's "
                            f"are {hidden} wide: it was fitted on another model; fit it again")
        for r in self.readouts:
            f = r.reads
            if not layers and f.beyond_final:
                fitted_on = self.fitted.get("engine")
                named = f" (--backend {fitted_on['name']})" if isinstance(fitted_on, Mapping) and fitted_on.get("name") \
                    else ""
                raise SpecError(f"{self.path}: question {r.qid!r}'s head reads {r.features}, and this engine gives "
                                f"the final state at the answer position alone: run it with the engine it was "
                                f"fitted on{named}, or fit it again on this one")
            if f.deepest > layers:
                raise SpecError(f"{self.path}: question {r.qid!r}'s head reads layer {f.deepest}, and the model has "
                                f"{layers}: it was fitted on another model; fit it again")


def exact_refusal(head: Head) -> str:
    """Why `--exact` cannot run with a head, in one line."""
    return (f"{head.path}: --exact scores close calls of the prompt again in float32, and a fitted head decides "
            f"from hidden states: leave --exact out (or 'head' out of the spec)")


def fingerprint(model: str, prefix_ids: Sequence[int], template_ids: Sequence[int], template: str,
                questions: Sequence[tuple[str, str, str, Sequence[str]]]) -> dict[str, str]:
    """What a head is fitted on, as digests: the model's identity, the prefix's token ids, the
    content-free item's ids and the template, and per question its id, kind, text and options."""
    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, ensure_ascii=False).encode("utf-8")).hexdigest()[:32]

    return {"model": digest(model), "prefix": digest(list(prefix_ids)),
            "template": digest([template, list(template_ids)]),
            "questions": digest([[qid, kind, text, list(options)] for qid, kind, text, options in questions])}


# -- the file --------------------------------------------------------------------------------------
def head_bytes(readouts: Sequence[Readout], fingerprint_: Mapping[str, str], layer: str,
               fitted: Mapping[str, Any]) -> bytes:
    """The head file's contents (safetensors: arrays and a JSON header)."""
    from safetensors.numpy import save

    tensors: dict[str, np.ndarray] = {}
    for i, r in enumerate(readouts):
        for name in ("mean", "scale", "coef", "intercept"):
            tensors[f"{i}.{name}"] = np.ascontiguousarray(getattr(r, name), dtype=np.float32)
        if r.familiar is not None:
            for name in FAMILIAR:
                tensors[f"{i}.familiar.{name}"] = np.ascontiguousarray(getattr(r.familiar, name), dtype=np.float32)
    meta = {"format": FORMAT, "version": VERSION, "layer": layer, "fingerprint": dict(fingerprint_),
            "weights": weights_digest(tensors),
            "questions": [{"id": r.qid, "options": list(r.options), "binary": r.binary, "features": r.features,
                           **({"cuts": dict(r.cuts)} if r.cuts else {}),
                           **({"familiar": {"residual": r.familiar.residual, "cut": r.familiar.cut}}
                              if r.familiar is not None else {}),
                           **({"reliability": r.reliability.to_json()} if r.reliability is not None else {})}
                          for r in readouts], "fitted": dict(fitted)}
    return save(tensors, metadata={META_KEY: json.dumps(meta, ensure_ascii=False)})


def weights_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """The digest of a head's arrays (names, shapes and float32 bytes, in name order): a weight
    changed after `fit` wrote it (a flipped bit) no longer matches its header."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name], dtype=np.float32)
        h.update(json.dumps([name, list(a.shape)]).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def load_head(value: Any, spec_path: Path) -> Head:
    """The `head:` key: a path (relative to the spec's folder) to a head file, read and checked.
    Raises SpecError naming the file for anything a head file must not be."""
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{spec_path}: 'head' must be the path of a head file written by prefixcache fit")
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = spec_path.parent / path
    where = f"{spec_path}: head {value!r}"
    return _parse(_read_checked(path, where), where, str(path))


def _read_checked(path: Path, where: str) -> bytes:
    """The head file's bytes, checked and read through one open file: what is checked (a
    regular file of a head's size, the user's own and written by no one else) is what is read,
    however the path's folders and links change meanwhile."""
    path = _followed(path, where)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | _NOFOLLOW)
    except OSError as exc:
        raise SpecError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{where} is not a regular file")
        if st.st_size > MAX_BYTES:
            raise SpecError(f"{where} is {st.st_size} bytes, larger than any head ({MAX_BYTES}): not a head file")
        _check_owner(st, where)
        chunks, left = [], st.st_size + 1  # one byte more: a file that grew since is read to its end and judged whole
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise SpecError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MAX_LINKS = 40  # links followed on the way to a head, as the kernel's own limit


def _followed(path: Path, where: str) -> Path:
    """The head's path with every link on the way followed, each made by this user or root: a
    link someone else made (in a shared folder where the head is to be written, say) chooses
    what is read, and is refused as a file of theirs is. The path returned holds no link (the
    open that follows refuses one put there since)."""
    me = os.geteuid() if hasattr(os, "geteuid") else None
    if me is None:
        return path
    path = Path(os.path.abspath(path))
    current, parts, links = Path(path.anchor), list(path.parts[1:]), 0
    while parts:
        part = parts.pop(0)
        if part == "..":  # `current` holds no link: its parent is the folder's own
            current = current.parent
            continue
        step = current / part
        try:
            st = os.lstat(step)
        except OSError:  # missing or unreadable: the open says so
            return Path(current, step.name, *parts)
        if not stat.S_ISLNK(st.st_mode):
            current = step
            continue
        if st.st_uid not in (me, 0):
            raise SpecError(f"{where}: {step} is a link made by another user (uid {st.st_uid}), who chooses what it "
                            f"points to; a head decides your answers: name the head's own file")
        links += 1
        if links > MAX_LINKS:
            raise SpecError(f"{where}: more than {MAX_LINKS} links on the way to the head")
        target = Path(os.readlink(step))
        parts = list(target.parts[1:] if target.is_absolute() else target.parts) + parts
        current = Path(target.anchor) if target.is_absolute() else current
    return current


def _check_owner(st: os.stat_result, where: str) -> None:
    """A head decides the answers: refuse one that someone else could have changed (owned by
    another user, or writable by group or others)."""
    me = os.geteuid() if hasattr(os, "geteuid") else None
    if me is None:
        return
    if st.st_uid not in (me, 0):
        raise SpecError(f"{where} belongs to another user (uid {st.st_uid}); a head decides your answers: "
                        f"copy it to a file of your own, or fit your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SpecError(f"{where} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}); a head "
                        f"decides your answers: chmod go-w it")


def _parse(data: bytes, where: str, path: str) -> Head:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    bad = f"{where} is not a head file written by prefixcache fit"
    try:
        arrays = load(data)
        meta = metadata_of(data)
    except (SafetensorError, ValueError, OverflowError, RecursionError) as exc:
        raise SpecError(f"{bad} ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})") from None
    try:
        info = json.loads(meta[META_KEY])
    except (KeyError, TypeError, ValueError, RecursionError):
        raise SpecError(f"{bad} (no readable '{META_KEY}' header)") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise SpecError(f"{bad} (its header is not a head's)")
    if info.get("version") not in READS:
        raise SpecError(f"{where} is a head of version {info.get('version')!r}; this prefixcache reads version "
                        f"{VERSION}: fit it again")
    questions, fp = info.get("questions"), info.get("fingerprint")
    if (not isinstance(questions, list) or not questions or not isinstance(fp, dict)
            or set(fp) != set(FINGERPRINT_PARTS) or not all(isinstance(v, str) for v in fp.values())):
        raise SpecError(f"{bad} (its header lacks the questions or the fingerprint)")
    if info.get("layer", "final") != "final":
        raise SpecError(f"{bad} (its header names layer {info.get('layer')!r}; a readout's own features name the "
                        f"layers it reads)")
    if info["version"] >= 2 and info.get("weights") != weights_digest(arrays):
        raise SpecError(f"{bad} (its weights' digest is not its header's: changed or damaged since fit wrote it; "
                        f"fit it again)")
    readouts = tuple(_readout(i, q, arrays, bad) for i, q in enumerate(questions))
    if len({r.qid for r in readouts}) != len(readouts):
        raise SpecError(f"{bad} (two readouts for one question)")
    expected = {f"{i}.{n}" for i, r in enumerate(readouts)
                for n in ("mean", "scale", "coef", "intercept", *(f"familiar.{f}" for f in FAMILIAR if r.familiar))}
    if set(arrays) != expected:
        raise SpecError(f"{bad} (it holds arrays {sorted(set(arrays) ^ expected)[:3]} it should not, or lacks them)")
    fitted = info.get("fitted")
    fitted = fitted if isinstance(fitted, dict) else {}
    return Head(path, readouts, dict(fp), str(info.get("layer", "final")), hashlib.sha256(data).hexdigest(), fitted)


def metadata_of(data: bytes) -> dict[str, str]:
    """A safetensors file's `__metadata__` (the arrays are read by safetensors itself). Raises
    ValueError for a truncated or unreadable header."""
    if len(data) < 8:
        raise ValueError("truncated")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("truncated header")
    header = json.loads(data[8: 8 + n])
    return header.get("__metadata__") or {}


def _readout(i: int, q: Any, arrays: Mapping[str, np.ndarray], bad: str) -> Readout:
    if (not isinstance(q, dict) or not isinstance(q.get("id"), str) or not isinstance(q.get("options"), list)
            or len(q["options"]) < 2 or not all(isinstance(o, str) for o in q["options"])
            or len(set(q["options"])) != len(q["options"])
            or not isinstance(q.get("binary"), bool) or not _features_ok(q.get("features"))):
        raise SpecError(f"{bad} (question {i + 1} of its header is malformed)")
    try:
        mean, scale, coef, intercept = (np.asarray(arrays[f"{i}.{n}"], dtype=np.float64)
                                        for n in ("mean", "scale", "coef", "intercept"))
    except KeyError as exc:
        raise SpecError(f"{bad} (array {exc.args[0]} is missing)") from None
    K, U = len(q["options"]), len(q["options"]) if q["binary"] else 1
    if coef.ndim != 2 or coef.shape[0] != K or coef.shape[1] < 2:
        raise SpecError(f"{bad} (question {q['id']!r}: coef has shape {list(coef.shape)}, not [{K}, width])")
    D = coef.shape[1]
    for name, arr, shape in (("mean", mean, (U, D)), ("scale", scale, (U, D)), ("intercept", intercept, (K,))):
        if arr.shape != shape:
            raise SpecError(f"{bad} (question {q['id']!r}: {name} has shape {list(arr.shape)}, not {list(shape)})")
    for name, arr in (("mean", mean), ("scale", scale), ("coef", coef), ("intercept", intercept)):
        if not np.isfinite(arr).all():
            raise SpecError(f"{bad} (question {q['id']!r}: {name} holds NaN or infinite values)")
    if (scale <= 0).any():
        raise SpecError(f"{bad} (question {q['id']!r}: a scale is not positive)")
    f = Features.parse(q["features"])
    extra = (1 if q["binary"] else K) if f.logprobs else 0
    if D - extra < len(f.views) or (D - extra) % len(f.views):
        raise SpecError(f"{bad} (question {q['id']!r}: its width {D} is not that of {q['features']})")
    cuts = q.get("cuts", {})
    if (not isinstance(cuts, dict) or q["binary"] and cuts or not set(cuts) <= set(q["options"])
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 for v in cuts.values())):
        raise SpecError(f"{bad} (question {q['id']!r}: its cuts are not probabilities of its options)")
    reliability = Reliability.from_json(q["reliability"]) if "reliability" in q else None
    if "reliability" in q and (reliability is None or q["binary"]):
        raise SpecError(f"{bad} (question {q['id']!r}: its reliability is not a step function of probabilities)")
    return Readout(q["id"], tuple(q["options"]), q["binary"], q["features"], mean, scale, coef, intercept,
                   {k: float(v) for k, v in cuts.items()}, _familiar(i, q, arrays, (D - extra), bad), reliability)


def _familiar(i: int, q: dict, arrays: Mapping[str, np.ndarray], width: int, bad: str) -> Familiar | None:
    """A readout's familiarity summary, where its header says it keeps one (checked)."""
    said = q.get("familiar")
    if said is None:
        return None
    if (not isinstance(said, dict) or set(said) != {"residual", "cut"}
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in said.values())):
        raise SpecError(f"{bad} (question {q['id']!r}: its familiarity header is malformed)")
    try:
        center, scale, basis, spread = (np.asarray(arrays[f"{i}.familiar.{n}"], dtype=np.float64) for n in FAMILIAR)
    except KeyError as exc:
        raise SpecError(f"{bad} (array {exc.args[0]} is missing)") from None
    found = Familiar(center, scale, basis, spread, float(said["residual"]), float(said["cut"]))
    wrong = found.check(width)
    if wrong:
        raise SpecError(f"{bad} (question {q['id']!r}: {wrong})")
    return found


def _features_ok(value: Any) -> bool:
    try:
        Features.parse(value)
    except ValueError:
        return False
    return True


def decided_by(readout: Readout, question: Any, states: Mapping[str, np.ndarray], logprobs: Sequence[float] | None
               ) -> Decision | Tags:
    """The head's decision for one question: its probabilities, decided as the question's own
    threshold says (a label set or choice abstains below it, or below its answer's own cut where
    `fit --target-accuracy` chose one; each tag is on at its threshold)."""
    probs = readout.probs(states, logprobs)
    if readout.binary:
        return Tags(probs, None, [p >= t for p, t in zip(probs, question.extra["thresholds"])])
    best, margin = ranked(probs)
    cut = question.threshold  # with a threshold (none: never abstain), an option's own cut where fit chose one
    cut = readout.cuts.get(readout.options[best], cut) if cut is not None else None
    return Decision(probs, None, None if cut is not None and probs[best] < cut else best, margin)
