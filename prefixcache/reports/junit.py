"""The JUnit XML report (--junit): one test case per check, failing only against a stated gate,
with names that stay the same from run to run so CI history can follow them. No torch."""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping, Optional
from xml.sax.saxutils import escape, quoteattr

Check = tuple[str, float, Optional[float], str]  # (case name, value, least value or None, the option that set it)

_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_chars(text: str) -> str:
    """`text` without the characters XML 1.0 cannot hold at all (most control characters)."""
    return _NOT_XML.sub("\ufffd", text)


def _attr(text: str) -> str:
    return quoteattr(_xml_chars(text))


def junit_xml(checks: Iterable[Check], name: str = "prefixcache", seconds: float = 0.0,
              properties: Mapping[str, Any] | None = None) -> str:
    """The report: a case per check (its value in the case's output, a failure when it is below
    its bound), and `properties` (JSON-encoded values) when given."""
    cases, failures = [], 0
    for case, value, bound, option in checks:
        failed = bound is not None and value < bound
        failures += failed
        body = f'<failure message={_attr(f"{case} {value:.4f} is below {option} {bound}")}/>' if failed else ""
        out = f"<system-out>{escape(_xml_chars(f'{case} {value:.4f}'))}</system-out>"
        cases.append(f'<testcase classname={_attr(name)} name={_attr(case)} time="0">{body}{out}</testcase>')
    props = "" if properties is None else "<properties>" + "".join(
        f'<property name={_attr(k)} value={_attr(json.dumps(v))}/>' for k, v in properties.items()) + "</properties>"
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name={_attr(name)} tests="{len(cases)}" '
            f'failures="{failures}" time="{seconds:.3f}">{props}{"".join(cases)}</testsuite>\n')
