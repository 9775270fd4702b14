"""The answer the first screen shows, put in the report where it is built: `attach` at the end of a host's work
(an audit, a live run, a plan of steps), `fill` for a saved report read back without one (`report render`,
`report merge`): the cli reaches diagnosis only through here, and the writers (reports/) only render it."""
from __future__ import annotations

from typing import Any

from mla_doctor.diagnosis.answer import answer_of, fill_answers
from mla_doctor.results import HostReport


def attach(report: HostReport, kb: Any = None) -> HostReport:
    report.answer = answer_of(report, kb)
    return report


def fill(doc: dict[str, Any]) -> dict[str, Any]:
    return fill_answers(doc)
