"""Label-set lint, before any model is loaded: problems a label set can have for scoring."""

from __future__ import annotations

from ..errors import SpecError
from .prompt import PromptBuilder


def _show(builder: PromptBuilder, ids: tuple[int, ...]) -> str:
    return "|".join(builder.tok.convert_ids_to_tokens(list(ids)))


def lint_labels(builder: PromptBuilder) -> list[str]:
    """Warnings (one line each) about the spec's labels; raises SpecError where scoring would be
    meaningless. Identical token ids are already refused when the candidates are built."""
    spec, cands = builder.spec, builder.candidates
    end = 1 if builder.end_of_answer else 0
    bare = {name: ids[: len(ids) - end] if end else ids for name, ids in cands.items()}
    warnings = []
    names = list(cands)
    for a in names:
        for b in names:
            if a != b and len(bare[a]) < len(bare[b]) and bare[b][: len(bare[a])] == bare[a]:
                if not end and spec.normalize == "sum":
                    raise SpecError(
                        f"{spec.path}: label {a!r} ({_show(builder, cands[a])}) is a token-prefix of {b!r} "
                        f"({_show(builder, cands[b])}) and no end-of-answer token follows the labels: "
                        f"{a!r} would always score at least as high; rename one"
                    )
                warnings.append(
                    f"label {a!r} ({_show(builder, bare[a])}) is a token-prefix of {b!r} ({_show(builder, bare[b])}); "
                    f"{'the end-of-answer token ' + repr(builder.end_of_answer) + ' tells them apart' if end else 'compare with care'}"
                )
    firsts: dict[int, list[str]] = {}
    for name, ids in bare.items():
        firsts.setdefault(ids[0], []).append(name)
    for tok, group in firsts.items():
        if len(group) > 1:
            warnings.append(
                f"labels {', '.join(map(repr, group))} share their first token {_show(builder, (tok,))!r}: "
                "fine for whole-sequence scoring (used here), fatal for first-token scoring"
            )
    lengths = {name: len(ids) for name, ids in cands.items()}
    if spec.normalize == "sum" and max(lengths.values()) >= 3 * min(lengths.values()):
        longest, shortest = max(lengths, key=lengths.get), min(lengths, key=lengths.get)
        warnings.append(
            f"label lengths differ a lot ({longest!r}: {lengths[longest]} tokens, {shortest!r}: "
            f"{lengths[shortest]}); with normalize: sum long labels are penalised, consider mean, pmi or calibrate"
        )
    return warnings
