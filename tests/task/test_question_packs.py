"""Typed question packs: what a spec's `questions:` accepts and refuses (before any model loads,
naming the file and the question), and the answer's shape rules (argmax, sums, expected score,
legend, the confidence formulas), checked on answers built from given distributions."""

from __future__ import annotations

import math

import pytest
from helpers import make_spec

from prefixcache.errors import SpecError
from prefixcache.task.decision import Decision
from prefixcache.task.kind import choice_confidence, score_confidence
from prefixcache.task.questions import parse_pack

TEAM = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Invoices", "tech": None, "sales": None}}
BLOCKED = {"type": "noul", "instructions": "Is the customer blocked?"}
MOOD = {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "angry"]}
PACK = {"team": TEAM, "blocked": BLOCKED, "mood": MOOD}


def test_a_pack_reads_into_questions_of_three_kinds(tmp_path):
    spec = make_spec(tmp_path, system="Route e-mails.", questions=PACK,
                     examples=[{"text": "Charged twice", "answers": {"team": "billing", "blocked": False, "mood": 2}}])
    assert [(q.id, q.type, q.options) for q in spec.questions] == [
        ("team", "choice", ("billing", "tech", "sales")), ("blocked", "noul", ("yes", "no")),
        ("mood", "score", ("0", "1", "2"))]
    assert spec.examples[0]["answers"] == {"team": "billing", "blocked": "no", "mood": "2"}
    assert spec.labels == () and spec.pruning_refusal() is None  # its choice question can be raced


def test_predicate_is_noul_and_yaml_booleans_name_its_sides(tmp_path):
    (q,) = parse_pack({"x": {"type": "predicate", "criteria": {True: "it is broken", "false": None}}}, "s.yaml")
    assert q.type == "noul" and q.descriptions == ("it is broken", None)
    assert "Yes means: it is broken" in q.branch()


def test_objects_and_arrays_are_shown_as_json():
    (q,) = parse_pack({"x": {"type": "choice", "instructions": {"ask": "which"}, "criteria": {"a": ["one", 1], "b": None}}},
                      "s.yaml")
    assert q.instructions == '{"ask": "which"}' and q.descriptions == ('["one", 1]', None)


def test_letters_show_lettered_options_and_score_the_letters():
    criteria = {f"option {i}": None for i in range(30)}
    (q,) = parse_pack({"x": {"type": "choice", "read": "letters", "criteria": criteria}}, "s.yaml")
    assert q.said[0] == ("A",) and q.said[25] == ("Z",) and q.said[26] == ("AA",) and q.said[29] == ("AD",)
    assert "A. option 0\n" in q.branch() and "AD. option 29" in q.branch()


BAD = [
    ({"x": {"type": "choice", "criteria": {"only": None}}}, "has 1 option; a question takes 2 to 255"),
    ({"x": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}}, "has 256 options"),
    ({"x": {"type": "score", "criteria": ["one"]}}, "has 1 level; a score question takes a list of 2 to 10"),
    ({"x": {"type": "score", "criteria": [str(i) for i in range(11)]}}, "has 11 levels"),
    ({"x": {"type": "score", "criteria": {"0": "low", "1": "high"}}}, "not a mapping"),
    ({"x": {"type": "ranking", "criteria": {"a": None}}}, "has type 'ranking'; the types are"),
    ({"x": {"criteria": {"a": None}}}, "has type None"),
    ({"x": {"type": "noul"}}, "needs 'instructions' or a described outcome"),
    ({"x": {"type": "choice", "criteria": {"a": None, "b": None}, "colour": 1}}, "unknown key 'colour'"),
    ({"x": {"type": "choice", "criteria": {"a": None, "b": None}, "normalize": "median"}}, "'normalize' must be one of"),
    ({"x": {"type": "score", "read": "letters", "criteria": ["a", "b"]}}, "'read: letters' applies to choice"),
    ({"x": {"type": "choice", "criteria": {"a": None, "b": None}, "words": {"a": ["b"]}}}, "are both scored as 'b'"),
    ({"x": {"type": "choice", "criteria": {"a": None, "b": None}, "words": {"c": ["x"]}}}, "names 'c'"),
    ({"x": {"type": "choice", "criteria": {True: None, "b": None}}}, "quote it"),
    ({}, "'questions' must be a mapping"),
    (["team"], "'questions' must be a mapping"),
]


@pytest.mark.parametrize("pack,message", BAD, ids=[m for _, m in BAD])
def test_bad_packs_are_refused_naming_the_file_and_question(tmp_path, pack, message):
    with pytest.raises(SpecError, match="spec.yaml") as caught:
        make_spec(tmp_path, questions=pack)
    assert message in str(caught.value)
    if pack and isinstance(pack, dict):
        assert "question 'x'" in str(caught.value)


def test_a_duplicate_option_is_refused(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("questions:\n  x:\n    type: choice\n    criteria:\n      a: one\n      a: two\n")
    from prefixcache.task.specfile import load_spec

    with pytest.raises(SpecError, match=r"spec.yaml:6: key 'a' is given twice"):
        load_spec(path)
    with pytest.raises(SpecError, match="lists option '1' twice"):  # YAML keys 1 and "1" name one option
        parse_pack({"x": {"type": "choice", "criteria": {1: None, "1": None}}}, "s.yaml")
    for twins in ({"caf\u00e9": None, "cafe\u0301": None}, {"Billing": None, "Billing ": None}):  # one text to a reader
        with pytest.raises(SpecError, match="which are the same text once spaces around them are trimmed"):
            parse_pack({"x": {"type": "choice", "criteria": twins}}, "s.yaml")


@pytest.mark.parametrize("answers,message", [
    ({"colour": "red"}, "answers 'colour', which is not one of the questions"),
    ({"team": "legal"}, "answers 'team' with 'legal', which is not one of its answers"),
    ({"blocked": "maybe"}, "answers 'blocked' with 'maybe'"),
    ({"mood": 3}, "answers 'mood' with 3"),
])
def test_an_example_answering_an_unknown_question_or_option_is_refused(tmp_path, answers, message):
    with pytest.raises(SpecError, match="example 1") as caught:
        make_spec(tmp_path, questions=PACK, examples=[{"text": "hi", "answers": answers}])
    assert message in str(caught.value)


@pytest.mark.parametrize("key", ["labels", "choices", "multi_label", "gold", "threshold"])
def test_one_question_keys_are_refused_beside_questions(tmp_path, key):
    value = {"labels": ["a", "b"], "choices": "options", "multi_label": True, "gold": "team", "threshold": 0.5}[key]
    with pytest.raises(SpecError, match=f"'{key}' cannot be given with 'questions'"):
        make_spec(tmp_path, questions=PACK, **{key: value})


def test_a_gold_value_must_be_one_of_the_questions_answers(tmp_path):
    spec = make_spec(tmp_path, questions={"team": {**TEAM, "gold": "team_gold"}, "blocked": {**BLOCKED, "gold": "b"}})
    spec.check_record({"text": "x", "team_gold": "tech", "b": "true"})
    spec.check_record({"text": "x", "team_gold": "tech", "b": False})
    with pytest.raises(ValueError, match="question 'team'"):
        spec.check_record({"text": "x", "team_gold": "legal", "b": True})
    with pytest.raises(ValueError, match="lacks the gold field 'b'"):
        spec.check_record({"text": "x", "team_gold": "tech"})


# -- the answer's shape --------------------------------------------------------------------------
def _answer(question, probs, best=None):
    best = max(range(len(probs)), key=probs.__getitem__) if best is None else best
    logprobs = [math.log(p) for p in probs]
    return question.kind.answer(question, Decision(list(probs), None, best, 0.0), logprobs)


def test_choice_answer_is_the_argmax_with_the_pinned_confidence():
    (q,) = parse_pack({"team": TEAM}, "s")
    answer = _answer(q, [0.2, 0.7, 0.1])
    assert answer["type"] == "choice" and answer["choice"] == "tech"
    assert list(answer["probabilities"]) == ["billing", "tech", "sales"]
    assert math.isclose(sum(answer["probabilities"].values()), 1.0)
    assert math.isclose(answer["confidence"], (0.7 - 1 / 3) / (1 - 1 / 3))
    assert answer["x_logprobs"]["tech"] == pytest.approx(math.log(0.7))


def test_noul_answer_is_p_yes_and_has_no_confidence():
    (q,) = parse_pack({"b": BLOCKED}, "s")
    answer = _answer(q, [0.3, 0.7])
    assert answer == {"type": "noul", "noul": 0.3, "x_logprobs": {"yes": math.log(0.3), "no": math.log(0.7)}}


def test_score_answer_is_the_expected_level_with_legend_and_pinned_confidence():
    (q,) = parse_pack({"m": MOOD}, "s")
    probs = [0.1, 0.6, 0.3]
    answer = _answer(q, probs)
    assert answer["score"] == pytest.approx(0 * 0.1 + 1 * 0.6 + 2 * 0.3)
    assert answer["legend"] == {"0": "calm", "1": "annoyed", "2": "angry"}
    assert list(answer["probabilities"]) == ["0", "1", "2"]
    d = (abs(0 - 1) + abs(1 - 1) + abs(2 - 1)) / 3
    assert answer["confidence"] == pytest.approx(max(0.0, 1 - (0.1 * 1 + 0.6 * 0 + 0.3 * 1) / d))


def test_confidence_formulas_at_their_ends():
    assert choice_confidence([1.0, 0.0, 0.0]) == 1.0
    assert choice_confidence([0.25] * 4) == pytest.approx(0.0)
    assert choice_confidence([1.0]) == 1.0
    assert score_confidence([0, 0, 1, 0]) == 1.0
    assert score_confidence([0.25] * 4) == pytest.approx(0.0)  # as spread as uniform
    assert score_confidence([0.5, 0, 0, 0.5]) == 0.0  # wider than uniform: floored at 0


def test_a_question_mark_in_a_flow_mapping_gets_a_hint(tmp_path):
    from prefixcache.task.specfile import load_spec

    path = tmp_path / "spec.yaml"
    path.write_text("questions:\n  b: {type: noul, instructions: Is it blocked?}\n")
    with pytest.raises(SpecError, match=r"spec.yaml:2:\d+: YAML syntax error: .*quote text that holds \?") as caught:
        load_spec(path)
    assert 'instructions: \\"Which team?\\"' not in str(caught.value)  # shown as the user writes it
    path.write_text('questions:\n  b: {type: noul, instructions: "Is it blocked?"}\n')
    assert load_spec(path).questions[0].instructions == "Is it blocked?"
