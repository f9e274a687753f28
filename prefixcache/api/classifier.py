"""`Classifier`: prefixcache from Python. The spec's prefix is encoded once when it is made; every
call reuses the model and the prefix, through the same batching, scorer and records as `run`.

Example:
    from prefixcache import Classifier

    clf = Classifier({"labels": ["billing", "technical", "account"],
                      "system": "You route support tickets."})
    for record in clf.classify(["I was charged twice", "The app crashes"]):
        print(record["id"], record["label"], record["prob"])
    clf(["I was charged twice"], candidate_labels=["refund", "bug"])   # zero-shot pipeline style

    asks = Classifier(questions={"team": {"type": "choice", "criteria": {"billing": None, "tech": None}},
                                 "blocked": {"type": "noul", "instructions": "Is the customer blocked?"}})
    asks("The app crashes at start")   # {"team": {"type": "choice", ...}, "blocked": {"type": "noul", ...}}
"""

from __future__ import annotations

import copy
import dataclasses
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Optional, Sequence, Sized, Union

from .. import compat
from ..data.items import Item, items_of
from ..data.records import Record
from ..errors import InputError, SpecError, UsageError
from ..run.pipeline import RunStats, classify
from ..scoring.options import BATCH_SIZE, BATCH_TOKENS, ScoringOptions
from ..scoring.prepare import Batching, Task
from ..task.overrides import with_overrides
from ..task.keys import spec_from_mapping
from ..task.spec import KNOWN_KEYS, TaskSpec
from ..task.specfile import load_spec
from .progress import bar_for
from .tables import rows_of

GOLD = "\x00gold"  # the labels Classifier.fit is given, as the items' gold field (no column is named so)

if TYPE_CHECKING:
    from ..scoring.scorer import ItemScorer

SpecLike = Union[str, Path, Mapping[str, Any], TaskSpec, None]


def unique(items: Iterable[Item]) -> Iterator[Item]:
    """`items`, refusing an id met twice (as the command line refuses it in a file)."""
    seen: dict[str, int] = {}
    for item in items:
        key = str(item.id)
        if key in seen:
            raise InputError(f"item {item.id!r} is given twice (items {seen[key]} and {item.line}); ids must be unique")
        seen[key] = item.line
        yield item


def _spec_of(spec: SpecLike, keys: Mapping[str, Any]) -> TaskSpec:
    """A `TaskSpec` from a YAML path, a mapping of spec keys or a spec, with `keys` set over it."""
    if isinstance(spec, TaskSpec):
        if keys:
            raise UsageError("give spec keys either in the TaskSpec or as keyword arguments, not both")
        return spec
    if spec is None or isinstance(spec, Mapping):
        return spec_from_mapping({**(spec or {}), **keys})
    if not isinstance(spec, (str, os.PathLike)):
        raise SpecError(f"a spec is a YAML file's path, a mapping of spec keys or a TaskSpec, not {type(spec).__name__}")
    return load_spec(spec, **keys)  # the file's keys, those given here set anew


def _labels(rows: Any, y: Any) -> list[Any]:
    """The labels `y` gives for `rows`: a list or Series, or the name of a column of them."""
    labels = [r[y] for r in rows] if isinstance(y, str) and rows and isinstance(rows[0], Mapping) else list(y)
    if len(labels) != len(rows):
        raise InputError(f"{len(rows)} items and {len(labels)} labels: give one label an item")
    return labels


_ENGINES: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()  # loaded models, while in use


def _scorer_for(task: Task, options: ScoringOptions) -> "ItemScorer":
    """The task's scorer; on the model another classifier of the same model and options holds
    loaded (a clone's), when there is one, else loading it."""
    from ..scoring.build import build_on, build_scorer  # torch: once the spec is known to be good

    key = (task.source.ref, options.device, options.dtype, options.backend or task.spec.backend, options.threads)
    engine = _ENGINES.get(key) if not options.exact else None
    if engine is not None:
        return build_on(task, engine, options)
    scorer = build_scorer(task, options)
    if not options.exact:
        _ENGINES[key] = scorer.engine
    return scorer


def _rows(X: Any) -> Any:
    """Items as `classify` takes them, from strings, dicts, a DataFrame or a Table (or any iterable)."""
    if isinstance(X, (str, list, tuple)):
        return X
    return rows_of(X) if hasattr(X, "columns") or hasattr(X, "to_pylist") else list(X)


class Classifier:
    """A spec's model and prefilled prefix, loaded once, classifying items from Python.

    Args:
        spec: a YAML spec file, a mapping of the same keys, or None with the keys as keyword
            arguments (`labels=`, `system=`, `examples=`, `template=`, ...).
        model: a hub id, a model folder or a .gguf file instead of the spec's (None: the spec's,
            else the embedded default).
        device, dtype: as `run --device`, `--dtype` ("auto": CUDA when present, float32 on the CPU).
        backend, threads: as `run --backend`, `--threads` (None: the spec's backend, else auto; every core).
        prompt_scores: as `run --prompt-scores` (a fitted head answers alone without it).
        cache_dir: converted models and stored prefixes (default: ~/.cache/prefixcache or
            PREFIXCACHE_CACHE_DIR).
        batch_size, batch_tokens: as `run`'s; the same values give the same records as `run`.
        progress: a bar on long calls (Rich in a terminal, tqdm in a notebook when installed).

    It follows scikit-learn's estimator conventions: `fit(X, y)` fits a head on the classifier
    itself and returns it, `predict`, `predict_proba`, `score` and `classes_`; `get_params` gives the
    arguments it was made with and `set_params` makes it again from them, so `sklearn.base.clone`,
    `Pipeline` and `cross_val_score` work (a clone shares the loaded model while one is alive).

    Raises the library's typed errors (`SpecError`, `InputError`, `ModelError`, ...); never exits.
    """

    _estimator_type = "classifier"

    def __init__(self, spec: SpecLike = None, *, model: Optional[str] = None, device: str = "auto",
                 dtype: str = "auto", cache_dir: Optional[Union[str, Path]] = None, batch_size: int = BATCH_SIZE,
                 batch_tokens: int = BATCH_TOKENS, exact: bool = False, progress: bool = True, backend: Optional[str] = None,
                 threads: Optional[int] = None, prompt_scores: bool = False, **keys: Any):
        if batch_size < 1 or batch_tokens < 1:
            raise UsageError(f"batch_size and batch_tokens must be 1 or more (got {batch_size} and {batch_tokens})")
        self._params = {"spec": spec, "model": model, "device": device, "dtype": dtype, "cache_dir": cache_dir,
                        "batch_size": batch_size, "batch_tokens": batch_tokens, "exact": exact, "progress": progress,
                        "backend": backend, "threads": threads, "prompt_scores": prompt_scores, **keys}
        self.spec = self._made = with_overrides(_spec_of(spec, keys), model=model)  # _made: as made, before any fit
        # as the command line reads them: PREFIXCACHE_CACHE_DIR, PREFIXCACHE_STORE_MAX_MB
        self.options = ScoringOptions.from_environment(cache_dir, device=device, dtype=dtype, exact=exact,
                                                       backend=backend, threads=threads, prompt_scores=prompt_scores)
        self.cache_dir, self.device, self.dtype, self.exact = self.options.cache_dir, device, dtype, exact
        self.progress = progress
        with compat.quietly():  # transformers' loading bars: the caller asked for records, not those
            self.task = Task.from_spec(self.spec, self.cache_dir)
            self._use(self.spec, _scorer_for(self.task, self.options))
        self._zero_shot: dict[tuple[tuple[str, ...], bool], Classifier] = {}
        self.fit_figures: Optional[list[dict[str, Any]]] = None  # set by `fit`

    def _use(self, spec: TaskSpec, scorer: "ItemScorer") -> None:
        """Decide by `spec` with `scorer` (its task's): the batches follow whether a head answers alone."""
        self.spec, self.task, self.scorer = spec, scorer.task, scorer
        self.batching = Batching(self._params["batch_size"], self._params["batch_tokens"], pruned=scorer.pruning
                                 ).answering(spec, bool(getattr(scorer, "head_only", False)))
        self._zero_shot = {}

    # -- scikit-learn's estimator protocol ---------------------------------------------------------
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The arguments this classifier was made with (as `__init__` takes them)."""
        return dict(self._params)

    def set_params(self, **params: Any) -> "Classifier":
        """This classifier made again with these arguments changed (a fitted head is dropped)."""
        odd = next((k for k in params if k not in self._params and k not in KNOWN_KEYS), None)
        if odd is not None:
            raise UsageError(f"Classifier has no parameter {odd!r}")
        args = {**self._params, **params}
        self.__init__(args.pop("spec"), **args)  # type: ignore[misc]
        return self

    def __sklearn_tags__(self) -> Any:
        """What scikit-learn asks of an estimator: a classifier of strings or dicts, usable before
        `fit` (the prompt alone answers)."""
        from sklearn.utils import ClassifierTags, InputTags, Tags, TargetTags

        return Tags(estimator_type="classifier", target_tags=TargetTags(required=False),
                    classifier_tags=ClassifierTags(multi_label=self.spec.multi_label), requires_fit=False,
                    no_validation=True, input_tags=InputTags(one_d_array=True, two_d_array=False, string=True,
                                                             dict=True))

    @property
    def classes_(self) -> Any:
        """The labels, in the order of `predict_proba`'s columns (numpy array)."""
        import numpy as np

        return np.array(self.labels, dtype=object)

    def score(self, X: Any, y: Any) -> float:
        """Accuracy of `predict(X)` against the labels `y` (a list, or the name of a column of `X`)."""
        rows = _rows(X)
        labels = _labels(rows, y)
        said = self.predict(rows)
        return sum(a == b for a, b in zip(said, labels)) / len(labels) if labels else 0.0

    @property
    def labels(self) -> list[str]:
        return list(self.spec.label_names)

    # -- records ----------------------------------------------------------------------------
    def classify(self, items: Union[str, Iterable[Union[str, Mapping[str, Any]]]], total: Optional[int] = None,
                 on_error: str = "fail") -> Iterator[Record]:
        """One record per item, in order, as `run` writes them. `items`: strings (the template's
        one field) or dicts of fields (the id from the spec's `id_field`, else the position, from
        1); a single string is one item. A generator in gives a generator out: items are read as
        batches fill. An item that cannot be scored (no text, too long for the model) raises
        `ItemError`, or with `on_error="skip"` gives a record with an `error` field instead."""
        if on_error not in ("fail", "skip"):
            raise UsageError(f"on_error must be 'fail' or 'skip', not {on_error!r}")
        if isinstance(items, str):
            items = [items]
        stats = RunStats()
        count = total if total is not None else (len(items) if isinstance(items, Sized) else None)
        batching = dataclasses.replace(self.batching, on_error=on_error)
        with bar_for(self.progress, count) as bar:
            for record in classify(self.scorer, self._items(items), batching, stats, None, bar.advance):
                yield record

    def _items(self, items: Iterable[Union[str, Mapping[str, Any]]]) -> Iterator[Item]:
        fields = self.spec.item_fields()
        return unique(items_of((self._fields(x, fields) for x in items), self.spec.id_field, "<python>"))

    def _fields(self, item: Union[str, Mapping[str, Any]], fields: Sequence[str]) -> Mapping[str, Any]:
        if isinstance(item, Mapping):
            odd = next((key for key in item if not isinstance(key, str)), None)
            if odd is not None:
                raise InputError(f"field names must be strings, not {odd!r} ({type(odd).__name__}): "
                                 f"rename the field or column")
            return item
        if isinstance(item, str):
            if len(fields) != 1:
                raise InputError(f"a string item fills one template field, but the template uses "
                                 f"{', '.join(map(repr, fields))}: give dicts of fields")
            return {fields[0]: item}
        raise InputError(f"an item must be a string or a dict of fields, not {type(item).__name__}")

    # -- tables -----------------------------------------------------------------------------
    def classify_df(self, table: Any, prefix: Optional[str] = None) -> Any:
        """A pandas DataFrame or a pyarrow Table with the prediction columns added: `label`,
        `prob`, `margin` and `prob_<label>` per label (for multiple choice, `index` and `probs`),
        and `error` for rows that could not be scored (no text, too long); the input columns are
        kept and the row order is the input's. `prefix` goes before each prediction column's name;
        None: none, or "pred_" when the table has a column of one of those names (a gold `label`)."""
        from .tables import add_predictions, check_columns, rows_of

        rows = rows_of(table)
        check_columns(list(table.column_names if hasattr(table, "column_names") else table.columns), self.spec)
        records = list(self.classify(rows, total=len(rows), on_error="skip"))
        return add_predictions(table, records, self.spec, prefix)

    def batch_fn(self, batch: Mapping[str, list], prefix: Optional[str] = None) -> dict[str, list]:
        """For Hugging Face `datasets`: `ds.map(clf.batch_fn, batched=True)` (a dict of columns in,
        the same with the prediction columns added out; `prefix` as `classify_df`'s)."""
        from .tables import add_predictions_to_columns, check_columns, rows_of_columns

        rows = rows_of_columns(batch)
        check_columns(list(batch), self.spec)
        records = list(self.classify(rows, total=len(rows), on_error="skip"))
        return add_predictions_to_columns(dict(batch), records, self.spec, prefix)

    # -- a head trained on your labels (scikit-learn's conventions) -----------------------------
    def fit(self, X: Any, y: Any, *, folds: int = 5, seed: int = 0, features: str = "state",
            prompt_sample: Optional[int] = None) -> "Classifier":
        """Fit a head on these labelled items and decide by it from now on (as `prefixcache fit`
        writes it); returns this classifier, as scikit-learn's estimators do. `X`: strings, dicts of
        fields, or a DataFrame or Table; `y` their labels (a list, a Series, or the name of a column
        of `X`; multi-label: lists of labels or strings separated by the spec's `gold_sep`);
        `features` as `fit --features`; `prompt_sample` as `fit --prompt-sample` (how many items have
        their options scored to measure the prompt alone: with many labels, the costly part; None:
        as many as cost about what reading the states costs, at least 20). Fitting again starts
        from the spec as it was made. The
        held-out figures of the head beside the prompt alone are in `.fit_figures` (one dict per
        question, as `fit`'s JSON). Raises UsageError for too few items or one class only."""
        from ..labelled.fit import fit_heads, fitted_questions, MIN_ITEMS
        from ..scoring.build import build_on

        if self.spec.questions:
            raise UsageError("Classifier.fit learns a label spec's labels; for typed questions, name each one's gold "
                             "field and use prefixcache fit")
        if folds < 2:
            raise UsageError(f"folds must be 2 or more (got {folds})")
        if prompt_sample is not None and prompt_sample < 1:
            raise UsageError(f"prompt_sample must be 1 or more (got {prompt_sample})")
        rows = _rows(X)
        labels = _labels(rows, y)
        if len(rows) < MIN_ITEMS:
            raise UsageError(f"{len(rows)} labelled items are too few to fit a head; fit needs at least {MIN_ITEMS}")
        made = self._made
        spec = dataclasses.replace(made, gold=GOLD, head=None)
        items = [dataclasses.replace(item, record={**item.record, GOLD: label})
                 for item, label in zip(self._items(rows), labels)]
        for item, label in zip(items, labels):
            try:
                spec.check_record(item.record)
            except ValueError as exc:  # the library's typed error, naming the item (the gold field is y, not a column)
                raise InputError(f"item {item.id!r} (label {label!r}) {str(exc).replace(f' ({GOLD})', '')}") from None
        base = build_on(self.task.with_spec(spec), self.scorer.engine, self.options.replace(prune="off", exact=False))
        found = fit_heads(base, items, fitted_questions(spec), self.batching, folds, seed, features=features,
                          prompt=prompt_sample)
        keys: dict[str, Any] = {"head": found.head()}
        thresholds = found.judged[0].thresholds if made.multi_label else None
        if thresholds is not None:
            keys["tag_thresholds"] = tuple(thresholds)
        fitted = dataclasses.replace(made, **keys)
        self._use(fitted, build_on(self.task.with_spec(fitted), self.scorer.engine, self.options))
        self.fit_figures = [j.to_json() for j in found.judged]
        return self

    def predict(self, X: Any) -> list[Any]:
        """The label of each item (multi-label: its list of labels; None where it abstains)."""
        return [r["labels"] if self.spec.multi_label else r.get("label") for r in self.classify(_rows(X))]

    def predict_proba(self, X: Any) -> Any:
        """Each item's probability of each label, in `labels` order: a numpy array [N, K]
        (multi-label: each label's own probability of applying)."""
        import numpy as np

        return np.array([[r["probs"][n] for n in self.labels] for r in self.classify(_rows(X))], dtype=float)

    # -- zero-shot pipeline style ---------------------------------------------------------------
    def __call__(self, sequences: Any, candidate_labels: Optional[Sequence[str]] = None,
                 multi_label: Optional[bool] = None) -> Any:
        """A DataFrame or Table: `classify_df`. Strings with `candidate_labels` (or the spec's
        labels): like `transformers.pipeline("zero-shot-classification")`, one
        `{"sequence", "labels", "scores"}` per string (a dict for one string), labels sorted by
        score; the labels are scored in one pass over the cached prefix, not one pass per label.
        `multi_label=True`: each label judged on its own (its score is P(yes) to the spec's
        question), as the pipeline's `multi_label`; None: as the spec says."""
        if not isinstance(sequences, (str, list, tuple)):
            return self.classify_df(sequences)
        one = isinstance(sequences, str)
        texts: list[str] = [sequences] if isinstance(sequences, str) else list(sequences)
        if self.spec.questions:  # typed questions: each string's answers, question id -> answer
            if candidate_labels is not None or multi_label:
                raise UsageError("candidate_labels and multi_label apply to label specs; this one asks questions")
            answers = [record["answers"] for record in self.classify(texts)]
            return answers[0] if one else answers
        clf = self._for_labels(candidate_labels, self.spec.multi_label if multi_label is None else multi_label)
        out = []
        for text, record in zip(texts, clf.classify(texts)):
            ranked = sorted(record["probs"].items(), key=lambda kv: -kv[1])
            out.append({"sequence": text, "labels": [k for k, _ in ranked], "scores": [v for _, v in ranked]})
        return out[0] if one else out

    def _for_labels(self, labels: Optional[Sequence[str]], multi_label: bool) -> "Classifier":
        from ..scoring.build import build_on

        if (labels is None or list(labels) == self.labels) and multi_label == self.spec.multi_label:
            return self
        labels = self.labels if labels is None else list(labels)
        key = (tuple(labels), multi_label)
        if key not in self._zero_shot:  # the same model and tokenizer, these labels and a prefix of their own
            twin = copy.copy(self)
            twin.spec = dataclasses.replace(self.spec, labels=spec_from_mapping({"labels": list(labels)}).labels,
                                            examples=(), gold=None, head=None,  # a head knows its own labels only
                                            multi_label=multi_label, tag_thresholds=(0.5,) * len(labels) if multi_label else ())
            if multi_label:
                twin.spec = dataclasses.replace(twin.spec, normalize="sum", threshold=None)
            twin.task = self.task.with_spec(twin.spec)
            twin.scorer = build_on(twin.task, self.scorer.engine, self.options.replace(cache_store=False, exact=False))
            twin.batching = dataclasses.replace(self.batching, pruned=twin.scorer.pruning, head_alone=False)
            twin._zero_shot = {}
            self._zero_shot[key] = twin
        return self._zero_shot[key]


__all__ = ["Classifier"]
