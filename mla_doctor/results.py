"""Typed results. Writers (text, JSON, ...) render these; the core never prints.

Every rendering goes through `to_dict()` (JSON, and the fleet's text, Markdown, JUnit, HTML) or
`redacted()` (the one-host text report): both pass through `redact.redact_tree`, the last net for secrets."""
from __future__ import annotations

import copy
import dataclasses
import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mla_doctor import __version__
from mla_doctor.errors import UnreachableError
from mla_doctor.exit_codes import ExitStatus, worst
from mla_doctor.redact import redact_text, redact_tree
from mla_doctor.report_sections import (EvidenceSection, GpuSection, HostAnswer, LogSection, ModelSection,
                                        PatchSection, RevertSection, Section, ServerSection, StaticSection,
                                        TimingsSection, TransportSection, VllmSection)


class Severity(str, enum.Enum):
    INFO = "info"
    WARN = "warn"
    FAIL = "fail"


class HostStatus(str, enum.Enum):
    OK = "ok"
    UNREACHABLE = "unreachable"
    ERROR = "error"


@dataclass
class Finding:
    code: str  # stable identifier, e.g. VLLM_FILES_MODIFIED
    severity: Severity
    summary: str
    evidence: list[str] = field(default_factory=list)
    action: str = ""


@dataclass
class HostReport:
    host: str
    status: HostStatus = HostStatus.OK
    error: str | None = None
    error_kind: str | None = None
    vllm: VllmSection | None = None
    # typed where the report is built (report_sections.py); a dict assigned here reads and renders alike
    static: StaticSection | None = None
    server: ServerSection | None = None
    model: ModelSection | None = None
    log: LogSection | None = None
    gpu: GpuSection | None = None
    findings: list[Finding] = field(default_factory=list)
    patch: PatchSection | None = None
    revert: RevertSection | None = None
    live: dict[str, Any] | None = None  # run id, settings, pids, baseline and restored completions
    prompts: list[dict[str, Any]] | None = None  # per prompt: calls, expected, observed
    evidence: EvidenceSection | None = None
    restored: bool | None = None  # None: nothing needed restoring
    transport: TransportSection = field(default_factory=TransportSection)
    timings: TimingsSection = field(default_factory=TimingsSection)
    # the answer the first screen shows, computed once where the report is built (diagnosis/answer.py)
    answer: HostAnswer | None = None
    exit_override: ExitStatus | None = None

    @classmethod
    def failed(cls, host: str, e: Exception, **kw: Any) -> HostReport:
        """A host that could not be reached (UnreachableError and its kin) or audited (any other error)."""
        report = cls(host=host, **kw)
        report.fail_with(e)
        return report

    def fail_with(self, e: Exception, prefix: str = "") -> None:
        self.status = HostStatus.UNREACHABLE if isinstance(e, UnreachableError) else HostStatus.ERROR
        self.error = prefix + getattr(e, "message", str(e))
        self.error_kind = type(e).__name__

    def redacted(self) -> HostReport:
        """A copy for rendering: every secret (secret-flag values, URL userinfo, secret env values) replaced."""
        r = copy.copy(self)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "findings":
                v = [dataclasses.replace(x, summary=redact_text(x.summary), evidence=redact_tree(list(x.evidence)),
                                         action=redact_text(x.action)) for x in v]
            elif isinstance(v, (Section, HostAnswer)):
                v = type(v).from_dict(redact_tree(v.to_dict(), f.name))
            elif isinstance(v, (dict, list, tuple, str)):
                v = redact_tree(v, f.name)
            setattr(r, f.name, v)
        return r

    def worst_severity(self) -> Severity | None:
        order = [Severity.INFO, Severity.WARN, Severity.FAIL]
        sev = [f.severity for f in self.findings]
        return max(sev, key=order.index) if sev else None

    def exit_status(self) -> ExitStatus:
        if self.exit_override is not None:
            return self.exit_override
        if self.status == HostStatus.UNREACHABLE:
            return ExitStatus.UNREACHABLE
        if self.status == HostStatus.ERROR:
            return ExitStatus.HOST_ERROR
        return ExitStatus.FAULT if self.worst_severity() == Severity.FAIL else ExitStatus.OK

    def verdict(self) -> str:
        """One word for the host: ok | warn | fail | unreachable | error."""
        if self.status != HostStatus.OK:
            return self.status.value
        sev = self.worst_severity()
        return sev.value if sev in (Severity.WARN, Severity.FAIL) else "ok"


@dataclass
class RunReport:
    command: str
    hosts: list[HostReport] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    duration_s: float = 0.0

    def exit_status(self) -> ExitStatus:
        return worst(h.exit_status() for h in self.hosts)

    def overall(self) -> str:
        verdicts = [h.verdict() for h in self.hosts]
        for v in ("unreachable", "error", "fail", "warn"):
            if v in verdicts:
                return v
        return "ok"

    def redacted(self) -> RunReport:
        return dataclasses.replace(self, command=redact_text(self.command), hosts=[h.redacted() for h in self.hosts])

    def to_dict(self) -> dict[str, Any]:
        return redact_tree({
            "tool": "mla-doctor",
            "version": __version__,
            "command": self.command,
            "overall": self.overall(),
            "exit_status": int(self.exit_status()),
            "exit_name": self.exit_status().name,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "duration_s": round(self.duration_s, 3),
            "hosts": [host_to_dict(h) for h in self.hosts],
        })


_SCALARS = frozenset((str, int, float, bool, type(None)))
_FIELDS: dict[type, tuple[str, ...]] = {}  # a dataclass's field names, read once per class (a fleet's reports)


def _plain(obj: Any) -> Any:
    """Dataclasses, enums, dicts, lists and tuples as JSON-ready data (dataclasses.asdict's rules, plus enums by
    value and keys as str). Exact scalar types return at once: most of a report's ~600 nodes per host."""
    t = type(obj)
    if t in _SCALARS:
        return obj
    if isinstance(obj, Section):  # a typed report section: its JSON, exactly as it was built or read
        return _plain(obj.to_dict())
    names = _FIELDS.get(t)
    if names is None and dataclasses.is_dataclass(t) and not isinstance(obj, type):
        names = _FIELDS[t] = tuple(f.name for f in dataclasses.fields(t))
    if names is not None:
        return {n: _plain(getattr(obj, n)) for n in names}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def host_to_dict(h: HostReport) -> dict[str, Any]:
    d = _plain(h)
    d.pop("exit_override", None)
    d["verdict"] = h.verdict()
    d["exit_status"] = int(h.exit_status())
    return redact_tree(d)


plain = _plain


def backend_of(report: HostReport | dict) -> str | None:
    """The decode backend the server selected, from its log (static) or the live evidence."""
    d = report if isinstance(report, dict) else {"log": report.log, "evidence": report.evidence}
    ev = LogSection.of(d.get("log")).evidence
    got = ev.get("decode_backend")
    if not got:
        lev = d.get("evidence")
        got = EvidenceSection.of(lev).decode_backend if isinstance(lev, Mapping) else None
    return got
