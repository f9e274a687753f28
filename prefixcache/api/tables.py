"""Tables in and out of a `Classifier`: pandas DataFrames, pyarrow Tables and dicts of columns
(Hugging Face `datasets` batches). The prediction columns: `label`, `prob`, `margin`, and per label
`prob_<label>` (multiple choice: `index` and `probs`, a list per row; multi-label: `labels`, a list
per row, and `prob_<label>`); `error` where an item could
not be scored. pandas and pyarrow are imported only when a table of theirs is given."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..data.records import Record, is_error
from ..errors import InputError
from ..task.spec import TaskSpec


def rows_of(table: Any) -> list[dict[str, Any]]:
    """The rows of a DataFrame or a Table, as dicts of their columns."""
    if hasattr(table, "to_pylist"):  # pyarrow.Table
        return table.to_pylist()
    if hasattr(table, "to_dict") and hasattr(table, "columns"):  # pandas.DataFrame
        return table.to_dict("records")
    raise InputError(f"a table must be a pandas DataFrame or a pyarrow Table, not {type(table).__name__}")


def prediction_columns(records: Sequence[Record], spec: TaskSpec) -> dict[str, list[Any]]:
    """The columns the records add, in order, one value per record."""
    heads = ("labels",) if spec.multi_label else ("label", "prob", "margin")
    cols: dict[str, list[Any]] = {name: [] for name in heads}
    if spec.choices:
        cols.update(index=[], probs=[])
    else:
        cols.update({f"prob_{name}": [] for name in spec.label_names})
    cols["error"] = []
    for r in records:
        failed = is_error(r)
        for name in heads + (("index", "probs") if spec.choices else ()):
            cols[name].append(None if failed else r.get(name))
        for name in spec.label_names if not spec.choices else ():
            cols[f"prob_{name}"].append(None if failed else r["probs"][name])
        cols["error"].append(r.get("error"))
    if not any(cols["error"]):
        del cols["error"]
    return cols


def _clash(existing: Sequence[str], added: Mapping[str, Any]) -> None:
    taken = [name for name in added if name in existing]
    if taken:
        raise InputError(f"the table already has column(s) {', '.join(map(repr, taken))} that the predictions "
                         f"add; rename them first")


def add_predictions(table: Any, records: Sequence[Record], spec: TaskSpec) -> Any:
    """`table` (same type) with the prediction columns after its own."""
    cols = prediction_columns(records, spec)
    if hasattr(table, "append_column"):  # pyarrow.Table
        import pyarrow as pa

        _clash(table.column_names, cols)
        for name, values in cols.items():
            table = table.append_column(name, pa.array(values))
        return table
    _clash(list(table.columns), cols)
    out = table.copy()
    for name, values in cols.items():
        out[name] = values
    return out


def add_predictions_to_columns(batch: dict[str, list], records: Sequence[Record], spec: TaskSpec) -> dict[str, list]:
    cols = prediction_columns(records, spec)
    _clash(list(batch), cols)
    return {**batch, **cols}
