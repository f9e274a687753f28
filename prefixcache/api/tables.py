"""Tables in and out of a `Classifier`: pandas DataFrames, pyarrow Tables and dicts of columns
(Hugging Face `datasets` batches). The prediction columns: `label`, `prob`, `margin`, and per label
`prob_<label>` (multiple choice: `index` and `probs`, a list per row; multi-label: `labels`, a list
per row, and `prob_<label>`); `error` where an item could
not be scored. pandas and pyarrow are imported only when a table of theirs is given."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..data.records import Record, flat_answers, is_error, question_columns
from ..errors import InputError
from ..task.questions import label_kind
from ..task.spec import TaskSpec


def rows_of(table: Any) -> list[dict[str, Any]]:
    """The rows of a DataFrame or a Table, as dicts of their columns (named once each, by strings)."""
    if hasattr(table, "to_pylist"):  # pyarrow.Table
        _names_ok(list(table.column_names))
        return table.to_pylist()
    if hasattr(table, "to_dict") and hasattr(table, "columns"):  # pandas.DataFrame
        _names_ok(list(table.columns))
        return table.to_dict("records")
    raise InputError(f"a table must be a pandas DataFrame or a pyarrow Table, not {type(table).__name__}")


def rows_of_columns(batch: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """The rows of a dict of columns (a `datasets` batch), which must all be as long."""
    names = list(batch)
    _names_ok(names)
    lengths = {name: len(batch[name]) for name in names}
    if len(set(lengths.values())) > 1:
        raise InputError("the columns are not all as long: " + ", ".join(f"{n!r} has {k}" for n, k in lengths.items()))
    return [dict(zip(names, values)) for values in zip(*(batch[n] for n in names))]


def check_columns(names: Sequence[str], spec: TaskSpec) -> None:
    """Refuse a table without a column the template uses (as `run` refuses such a file): every
    row would fail the same way."""
    missing = [f for f in spec.item_fields() if f not in names]
    if missing:
        raise InputError(f"the table has no column {missing[0]!r}, which the template uses "
                         f"({spec.template.text!r}); its columns: {', '.join(map(repr, names[:12]))}"
                         f"{' ...' if len(names) > 12 else ''}")


def _names_ok(names: Sequence[Any]) -> None:
    odd = next((name for name in names if not isinstance(name, str)), None)
    if odd is not None:
        raise InputError(f"column names must be strings, not {odd!r} ({type(odd).__name__}): rename the column")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise InputError(f"the table has two columns named {twice[0]!r}: rename one")


def prediction_columns(records: Sequence[Record], spec: TaskSpec, error: bool = False) -> dict[str, list[Any]]:
    """The columns the records add, in order, one value per record; `error` only when a record
    is one (always with `error`: batches of one dataset must all have the same columns). Typed
    questions: each question's flat columns, as a CSV output has them (`team`, `team__confidence`,
    `team__p__billing`, ...)."""
    if spec.questions:
        return _question_columns(records, spec, error)
    fills = label_kind(spec).table(spec)
    cols: dict[str, list[Any]] = {name: [] for name, _ in fills}
    cols["error"] = []
    for r in records:
        failed = is_error(r)
        for name, fill in fills:
            cols[name].append(None if failed else fill(r))
        cols["error"].append(r.get("error"))
    if not any(cols["error"]) and not error:
        del cols["error"]
    return cols


def _question_columns(records: Sequence[Record], spec: TaskSpec, error: bool) -> dict[str, list[Any]]:
    names = [c for c in question_columns(spec.questions) if not c.endswith(("__gold", "__correct"))]
    cols: dict[str, list[Any]] = {name: [] for name in names + ["error"]}
    for r in records:
        flat = {} if is_error(r) else flat_answers(r)
        for name in names:
            cols[name].append(flat.get(name))
        cols["error"].append(r.get("error"))
    if not any(cols["error"]) and not error:
        del cols["error"]
    return cols


AUTO_PREFIX = "pred_"  # when the table has a column the predictions would add (a gold `label`)


def _named(existing: Sequence[str], cols: dict[str, list[Any]], prefix: str | None) -> dict[str, list[Any]]:
    """The prediction columns under their names: `prefix` before each; None: none, or
    AUTO_PREFIX when a name is taken. A name still taken is an error."""
    if prefix is None:
        prefix = AUTO_PREFIX if any(name in existing for name in cols) else ""
    named = {prefix + name: values for name, values in cols.items()}
    taken = [name for name in named if name in existing]
    if taken:
        raise InputError(f"the table already has column(s) {', '.join(map(repr, taken))} that the predictions "
                         f"add; rename them, or give another prefix")
    return named


def add_predictions(table: Any, records: Sequence[Record], spec: TaskSpec, prefix: str | None = None) -> Any:
    """`table` (same type) with the prediction columns after its own (see `_named`)."""
    existing = list(table.column_names) if hasattr(table, "append_column") else list(table.columns)
    cols = _named(existing, prediction_columns(records, spec), prefix)
    if hasattr(table, "append_column"):  # pyarrow.Table
        import pyarrow as pa

        for name, values in cols.items():
            table = table.append_column(name, pa.array(values))
        return table
    out = table.copy()
    for name, values in cols.items():
        out[name] = values
    return out


def add_predictions_to_columns(batch: dict[str, list], records: Sequence[Record], spec: TaskSpec,
                               prefix: str | None = None) -> dict[str, list]:
    return {**batch, **_named(list(batch), prediction_columns(records, spec, error=True), prefix)}
