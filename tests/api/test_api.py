"""prefixcache from Python: the same records as `run` on the same items, whatever the items come
as (strings, dicts, a generator, a DataFrame, an Arrow table, a `datasets` batch)."""

from __future__ import annotations

import json

import pytest
from helpers import QUESTIONS, invoke, question_row_is, records, write_spec

from prefixcache import Classifier
from prefixcache.errors import InputError, SpecError, UsageError

TICKETS = ["The app crashes when I open a project.", "I was charged twice, please refund.", "Hi",
           "I forgot my password and cannot sign in.", "Error 502 from the API", "refund my invoice",
           "x", "The quick brown fox jumps over the lazy dog."]
LABELS = ["tech", "technical", "billing", "account access"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("api")
    spec = write_spec(tmp, model=str(tiny_model_dir), labels=LABELS)
    items = tmp / "items.jsonl"
    items.write_text("".join(json.dumps({"id": f"t{n}", "text": t}) + "\n" for n, t in enumerate(TICKETS)))
    out = tmp / "out.jsonl"
    assert invoke("run", spec, items, "-o", out, "-b", 3, "-q").exit_code == 0
    clf = Classifier(spec, batch_size=3, progress=False)
    return spec, items, records(out), clf


@pytest.fixture()
def tiny_clf(setup):
    return setup[3]


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g = {k: v for k, v in g.items() if k != "ms"}
        assert g.keys() == w.keys() and g["label"] == w["label"] and g["id"] == w["id"]
        assert all(abs(g["logprobs"][k] - w["logprobs"][k]) < 1e-6 for k in w["logprobs"])
        assert {k: v for k, v in g.items() if k not in ("logprobs",)} == {k: v for k, v in w.items() if k != "logprobs"}


def test_dicts_give_the_records_run_writes(setup):
    _, _, want, clf = setup
    _close(list(clf.classify({"id": f"t{n}", "text": t} for n, t in enumerate(TICKETS))), want)


def test_strings_are_numbered_as_a_file_without_ids_is(setup, tmp_path):
    spec, _, _, clf = setup
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": t}) + "\n" for t in TICKETS))
    out = tmp_path / "o.jsonl"
    assert invoke("run", spec, plain, "-o", out, "-b", 3, "-q").exit_code == 0
    _close(list(clf.classify(TICKETS)), records(out))


def test_a_generator_in_is_read_as_batches_fill(setup):
    _, _, want, clf = setup
    pulled = []

    def feed():
        for n, t in enumerate(TICKETS):
            pulled.append(n)
            yield {"id": f"t{n}", "text": t}

    stream = clf.classify(feed())
    first = next(stream)
    assert first["id"] == "t0" and len(pulled) <= 4  # one batch of 3 (and the item that closed it)
    _close([first, *stream], want)


def test_a_dataframe_and_an_arrow_table_get_prediction_columns(setup):
    pd = pytest.importorskip("pandas")
    pa = pytest.importorskip("pyarrow")
    _, _, want, clf = setup
    df = pd.DataFrame({"id": [f"t{n}" for n in range(len(TICKETS))], "text": TICKETS, "team": ["a"] * len(TICKETS)})
    out = clf.classify_df(df)
    assert list(out.columns) == ["id", "text", "team", "label", "prob", "margin", *(f"prob_{x}" for x in LABELS)]
    assert list(out["label"]) == [r["label"] for r in want] and list(out["prob"]) == [r["prob"] for r in want]
    assert list(df.columns) == ["id", "text", "team"]  # the input is left as it was
    table = clf(pa.Table.from_pandas(df))
    assert isinstance(table, pa.Table) and table.column("label").to_pylist() == [r["label"] for r in want]
    assert table.column(f"prob_{LABELS[0]}").to_pylist() == [r["probs"][LABELS[0]] for r in want]


def test_a_datasets_batch(setup):
    _, _, want, clf = setup
    batch = {"id": [f"t{n}" for n in range(len(TICKETS))], "text": list(TICKETS)}
    out = clf.batch_fn(batch)
    assert out["text"] == batch["text"] and out["label"] == [r["label"] for r in want]


def test_the_zero_shot_call_has_the_pipelines_shape(setup):
    _, _, _, clf = setup
    one = clf("The app crashes", candidate_labels=["bug", "money", "login"])
    assert one["sequence"] == "The app crashes" and sorted(one["labels"]) == ["bug", "login", "money"]
    assert one["scores"] == sorted(one["scores"], reverse=True) and abs(sum(one["scores"]) - 1) < 1e-5
    many = clf(["a", "b"], candidate_labels=["bug", "money"])
    assert [m["sequence"] for m in many] == ["a", "b"]
    # the same labels through a spec of their own give the same scores
    twin = Classifier(labels=["bug", "money", "login"], system=clf.spec.system, template="Ticket: {text}",
                      model=clf.spec.model, progress=False)
    [record] = twin.classify(["The app crashes"])
    assert one["scores"] == pytest.approx(sorted(record["probs"].values(), reverse=True), abs=1e-6)


def test_errors_are_typed_and_nothing_exits(setup, tiny_model_dir):
    _, _, _, clf = setup
    with pytest.raises(SpecError, match="unknown key 'lables'"):
        Classifier(lables=["a"], model=str(tiny_model_dir))
    two_fields = Classifier(labels=["a", "b"], template="{title}: {body}", model=str(tiny_model_dir), progress=False)
    with pytest.raises(InputError, match="a string item fills one template field"):
        list(two_fields.classify(["just text"]))
    with pytest.raises(InputError, match="already has column"):
        clf.batch_fn({"text": ["x"], "label": ["y"]}, prefix="")


def test_the_ray_callable_adds_predictions_to_each_batch(setup):
    pd = pytest.importorskip("pandas")
    from prefixcache.ray import Classify

    spec, _, want, _ = setup
    actor = Classify(str(spec), batch_size=3)
    frame = actor(pd.DataFrame({"id": [f"t{n}" for n in range(len(TICKETS))], "text": TICKETS}))
    assert list(frame["label"]) == [r["label"] for r in want]
    columns = actor({"id": [f"t{n}" for n in range(3)], "text": TICKETS[:3]})
    assert columns["label"] == [r["label"] for r in want[:3]]


def test_the_ray_callable_adds_each_questions_columns(tmp_path, tiny_model_dir):
    """Typed questions through the Ray callable: per-question columns, the CLI's numbers (the same
    callable on a local cluster: tests/test_ray.py)."""
    pd = pytest.importorskip("pandas")
    from prefixcache.ray import Classify

    spec = write_spec(tmp_path, model=str(tiny_model_dir), questions=QUESTIONS)
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps({"id": f"t{n}", "text": t}) + "\n" for n, t in enumerate(TICKETS)))
    assert invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "-q").exit_code == 0
    want = records(tmp_path / "out.jsonl")
    frame = Classify(str(spec), batch_size=3)(pd.DataFrame({"id": [f"t{n}" for n in range(len(TICKETS))], "text": TICKETS}))
    for row, record in zip(frame.to_dict("records"), want, strict=True):
        assert question_row_is(row, record["answers"])


def test_spec_keys_set_over_a_file_and_a_zero_shot_call_on_a_spec_with_gold(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS, gold="answer")
    clf = Classifier(spec, labels=["tech", "billing"], progress=False)
    assert clf.labels == ["tech", "billing"] and clf.spec.gold == "answer"  # the file's keys, labels set anew
    [record] = clf.classify([{"text": "refund", "answer": "billing"}])
    assert record["gold"] == "billing"
    shot = clf("refund please", candidate_labels=["money", "bug"])  # strings carry no gold field
    assert sorted(shot["labels"]) == ["bug", "money"]


def test_multi_label_call_and_table_columns(setup):
    pd = pytest.importorskip("pandas")
    _, _, _, clf = setup
    one = clf("The app crashes and I was charged twice", candidate_labels=["bug", "money", "login"], multi_label=True)
    assert sorted(one["labels"]) == ["bug", "login", "money"] and one["scores"] == sorted(one["scores"], reverse=True)
    assert abs(sum(one["scores"]) - 1) > 1e-3  # each label on its own: the scores need not sum to one
    # the same as a multi-label spec of its own, scored through the run pipeline
    twin = Classifier(labels=["bug", "money", "login"], system=clf.spec.system, template="Ticket: {text}",
                      model=clf.spec.model, multi_label=True, progress=False)
    [record] = twin.classify(["The app crashes and I was charged twice"])
    assert one["scores"] == pytest.approx(sorted(record["probs"].values(), reverse=True), abs=1e-6)
    table = twin.classify_df(pd.DataFrame({"text": ["refund please", "crash"]}))
    assert list(table.columns) == ["text", "labels", "prob_bug", "prob_money", "prob_login"]
    assert all(isinstance(v, list) for v in table["labels"])


# -- one bad row, missing text, odd inputs ------------------------------------------------------
def test_blank_rows_get_an_error_and_the_others_their_predictions(tiny_clf):
    pd = pytest.importorskip("pandas")
    pa = pytest.importorskip("pyarrow")

    texts = ["I was charged twice", None, "", "The app crashes", float("nan")]
    df = pd.DataFrame({"text": texts})
    out = tiny_clf.classify_df(df)
    assert list(out["error"].notna()) == [False, True, True, False, True]
    assert out["label"].notna().tolist() == [True, False, False, True, False]
    assert "nothing to classify" in out["error"][2] and "missing value" in out["error"][4]
    scored = list(tiny_clf.classify(["I was charged twice", "The app crashes"]))
    assert [out["label"][0], out["label"][3]] == [r["label"] for r in scored]
    table = tiny_clf.classify_df(pa.table({"text": [t if isinstance(t, str) else None for t in texts]}))
    assert "has no value in field 'text'" in table.column("error").to_pylist()[1]
    batch = tiny_clf.batch_fn({"text": texts})
    assert [e is not None for e in batch["error"]] == [True if t in (None, "") or t != t else False for t in texts]


def test_a_table_without_the_templates_column_is_refused_in_one_line(tiny_clf):
    pd = pytest.importorskip("pandas")
    pa = pytest.importorskip("pyarrow")

    for call, table in ((tiny_clf.classify_df, pd.DataFrame({"body": ["a", "b"]})),
                        (tiny_clf.classify_df, pa.table({"body": ["a", "b"]})),
                        (tiny_clf.batch_fn, {"body": ["a", "b"]})):
        with pytest.raises(InputError, match="the table has no column 'text', which the template uses .*'body'"):
            call(table)


def test_a_string_is_one_text_everywhere(tiny_clf):
    records = list(tiny_clf.classify("hello"))
    assert len(records) == 1 and records[0]["label"] == tiny_clf("hello")["labels"][0]


def test_a_gold_label_column_is_kept_and_the_predictions_prefixed(tiny_clf):
    pd = pytest.importorskip("pandas")

    out = tiny_clf.classify_df(pd.DataFrame({"text": ["I was charged twice"], "label": [2]}))
    assert out["label"].tolist() == [2] and out["pred_label"].tolist()[0] in tiny_clf.labels
    batch = tiny_clf.batch_fn({"text": ["a b"], "label": [0]})
    assert batch["label"] == [0] and "pred_prob" in batch
    with pytest.raises(InputError, match="give another prefix"):
        tiny_clf.classify_df(pd.DataFrame({"text": ["x"], "label": [1], "pred_label": [1]}), prefix="pred_")


@pytest.mark.parametrize("call, message", [
    (lambda clf: list(clf.classify([{"id": 1, "text": "a"}, {"id": 1, "text": "b"}])), "is given twice"),
    (lambda clf: list(clf.classify([{"text": "a", 0: "b"}])), "field names must be strings"),
    (lambda clf: list(clf.classify([{"text": b"bytes"}])), "bytes in field 'text'"),
    (lambda clf: list(clf.classify(["a\ud800b"])), "unpaired surrogate"),
    (lambda clf: clf.batch_fn({"text": ["a", "b"], "id": [1]}), "not all as long"),
    (lambda clf: clf.classify_df(__import__("pandas").DataFrame([["a", "b"]], columns=["text", "text"])),
     "two columns named 'text'"),
    (lambda clf: clf.classify_df(__import__("pandas").DataFrame({0: ["a"]})), "column names must be strings"),
])
def test_odd_inputs_are_typed_errors(tiny_clf, call, message):
    from prefixcache.errors import PrefixcacheError

    with pytest.raises(PrefixcacheError, match=message):
        call(tiny_clf)


@pytest.mark.parametrize("spec, kwargs, message", [
    (["labels", "a"], {}, "not list"), (None, {"labels": ["a", "b"], "batch_size": 0}, "batch_size"),
])
def test_a_bad_spec_or_size_is_a_typed_error(spec, kwargs, message):
    from prefixcache import Classifier
    from prefixcache.errors import PrefixcacheError

    with pytest.raises(PrefixcacheError, match=message):
        Classifier(spec, **kwargs)


def test_the_cache_and_its_bound_reach_the_classifier_as_they_reach_run(tmp_path, tiny_model_dir, monkeypatch):
    """PREFIXCACHE_CACHE_DIR and PREFIXCACHE_STORE_MAX_MB are read by every entry point in one place."""
    from prefixcache.run.options import RunOptions

    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PREFIXCACHE_STORE_MAX_MB", "3")
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=LABELS)
    clf = Classifier(spec, progress=False)
    assert clf.options.cache_dir == tmp_path / "cache" and clf.options.store_max_bytes == 3 * 2**20
    assert list((tmp_path / "cache" / "prefixes").glob("*.safetensors"))  # its prefix kept in that cache
    run = RunOptions(spec, "items.jsonl", cache_dir=tmp_path / "cache").scoring()  # what run and tune build from
    assert run.replace(device="auto") == clf.options.replace(device="auto")
    monkeypatch.setenv("PREFIXCACHE_STORE_MAX_MB", "lots")
    with pytest.raises(UsageError, match="PREFIXCACHE_STORE_MAX_MB"):
        Classifier(spec, progress=False)
