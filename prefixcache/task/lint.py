"""Label-set lint, before any model is loaded: problems a label set can have for scoring."""

from __future__ import annotations

from ..errors import SpecError
from .prompt import PromptBuilder
from .spec import DEFAULT_ANSWER_PREFIX


SHARED_SHOWN = 3  # groups of labels sharing a first token listed one a line; more are summed up in one


def _show(builder: PromptBuilder, ids: tuple[int, ...]) -> str:
    return "|".join(builder.tok.convert_ids_to_tokens(list(ids)))


def _owners(builder: PromptBuilder) -> dict[str, list[str]]:
    """Each scored text (a label, or a form of a verbalized label) -> the labels it counts for."""
    texts = list(builder.candidates)
    owner: dict[str, list[str]] = {text: [] for text in texts}
    for name, members in zip(builder.groups.names, builder.groups.members):
        for i in members:
            owner[texts[i]].append(name)
    return owner


def _what(owner: dict[str, list[str]], text: str, word: str = "label ") -> str:
    """'label x' (`word` before a label's name), or 'form y of label x'."""
    return f"{word}{text!r}" if owner[text] == [text] else f"form {text!r} of label {owner[text][0]!r}"


def lint_layout(builder: PromptBuilder) -> list[str]:
    """Warnings about spec keys the prompt's layout does not use."""
    warnings = []
    if builder.mode == "chat" and builder.spec.answer_prefix != DEFAULT_ANSWER_PREFIX:
        warnings.append("'answer_prefix' is not used: the model's chat template puts the answer in the assistant's "
                        "turn; give 'format: plain' to use it")
    for q in builder.spec.questions:
        described = [o for o, d in zip(q.options, q.descriptions) if d]
        if q.extra.get("list", True) is False and described:
            warnings.append(f"question {q.id!r}: 'list: false' shows the model only the instructions, so the "
                            f"descriptions of {len(described)} option{'s' * (len(described) != 1)} (first: "
                            f"{described[0]!r}) are never read; list the options, or put what matters in the "
                            f"instructions")
    return warnings


def lint_labels(builder: PromptBuilder) -> list[str]:
    """Warnings (one line each) about the spec's labels; raises SpecError where scoring would be
    meaningless. Identical token ids are already refused when the candidates are built."""
    spec, cands = builder.spec, builder.candidates
    if spec.multi_label:  # each label is its own yes/no question: nothing for the labels to collide on
        return []
    end = 1 if builder.end_of_answer else 0
    bare = {name: ids[: len(ids) - end] if end else ids for name, ids in cands.items()}
    owner = _owners(builder)
    warnings = [f"form {form!r} belongs to labels {', '.join(map(repr, labels))}: its probability counts for each"
                for form, labels in owner.items() if len(labels) > 1]
    names = list(cands)
    for a in names:
        for b in names:
            if owner[a] == owner[b] and len(owner[a]) == 1:
                continue  # two forms of one label: their probabilities are summed, not compared
            if a != b and len(bare[a]) < len(bare[b]) and bare[b][: len(bare[a])] == bare[a]:
                if not end and spec.normalize == "sum" and builder.groups.plain:
                    raise SpecError(
                        f"{spec.path}: label {a!r} ({_show(builder, cands[a])}) is a token-prefix of {b!r} "
                        f"({_show(builder, cands[b])}) and no end-of-answer token follows the labels: "
                        f"{a!r} would always score at least as high; rename one"
                    )
                longer = _what(owner, b, "")
                warnings.append(
                    f"{_what(owner, a)} ({_show(builder, bare[a])}) is a token-prefix of {longer} "
                    f"({_show(builder, bare[b])}); "
                    f"{'the end-of-answer token ' + repr(builder.end_of_answer) + ' tells them apart' if end else 'compare with care'}"
                )
    if not builder.groups.plain:
        return warnings  # forms: the checks below are about one text per label
    return warnings + _shared_first_tokens(builder, bare) + _length_spread(spec.normalize, cands)


def _shared_first_tokens(builder: PromptBuilder, bare: dict[str, tuple[int, ...]]) -> list[str]:
    """Labels that share their first token: harmless here, fatal for first-token scoring."""
    firsts: dict[int, list[str]] = {}
    for name, ids in bare.items():
        firsts.setdefault(ids[0], []).append(name)
    shared = [(tok, group) for tok, group in firsts.items() if len(group) > 1]
    if len(shared) > SHARED_SHOWN:  # many labels: one line, not one per group
        examples = "; ".join(f"{', '.join(map(repr, group[:3]))}{' ...' if len(group) > 3 else ''}"
                             for _, group in shared[:2])
        return [f"{len(shared)} groups of labels share their first token ({examples}; ...): fine for "
                "whole-sequence scoring (used here), fatal for first-token scoring"]
    return [f"labels {', '.join(map(repr, group))} share their first token {_show(builder, (tok,))!r}: "
            "fine for whole-sequence scoring (used here), fatal for first-token scoring" for tok, group in shared]


def _length_spread(normalize: str, cands: dict[str, tuple[int, ...]]) -> list[str]:
    """Label lengths far apart under `normalize: sum`, which penalises the long ones."""
    lengths = {name: len(ids) for name, ids in cands.items()}
    if normalize != "sum" or max(lengths.values()) < 3 * min(lengths.values()):
        return []
    longest, shortest = max(lengths, key=lengths.__getitem__), min(lengths, key=lengths.__getitem__)
    return [f"label lengths differ a lot ({longest!r}: {lengths[longest]} tokens, {shortest!r}: "
            f"{lengths[shortest]}); with normalize: sum long labels are penalised, consider mean, pmi or calibrate"]
