"""Inventory and runbook expectations (`expect:`) checked against one host's audit: pure, findings out."""
from __future__ import annotations

from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from mla_doctor.diagnosis.live_verdict import EXPECT_VALUES
from mla_doctor.report_sections import StaticSection, VllmSection
from mla_doctor.results import Finding, HostReport, Severity, backend_of

# what `expect:` (inventory, runbook) may check; prefill/decode take EXPECT_VALUES
EXPECT_KEYS = ("vllm", "distribution", "integrity", "sparse", "backend", "prefill", "decode")
__all__ = ["EXPECT_KEYS", "EXPECT_VALUES", "check_expectations"]


def check_expectations(report: HostReport, exp: dict[str, Any]) -> list[Finding]:
    """Pure: the host's result against its expectations -> findings (unmet = fail)."""
    if not exp:
        return []
    met, unmet, later = [], [], []
    v = VllmSection.of(report.vllm)
    st = StaticSection.of(report.static)
    for key, want in exp.items():
        if key == "vllm":
            got = v.version
            try:
                ok = got is not None and SpecifierSet(str(want)).contains(Version(got), prereleases=True)
            except InvalidVersion:
                ok = False
            (met if ok else unmet).append(f"vllm {want} (found {got})")
        elif key == "distribution":
            got = v.distribution
            (met if got == want else unmet).append(f"distribution {want} (found {got})")
        elif key == "integrity":
            bad = list(st.modified_files) + list(st.missing_files)
            if want == "clean":
                (met if not bad else unmet).append(
                    "integrity clean" + (f" (modified/missing: {', '.join(bad[:5])})" if bad else ""))
        elif key == "sparse":
            got = bool(st.sparse_gate.get("present"))
            (met if got == bool(want) else unmet).append(f"sparse {str(want).lower()} (found {str(got).lower()})")
        elif key == "backend":
            got = backend_of(report)
            if got is None:
                later.append(f"backend {want}: not observed (no server log; the live diagnosis shows it)")
            else:
                (met if got.lower() == str(want).lower() else unmet).append(f"backend {want} (found {got})")
        elif key in ("prefill", "decode"):
            if report.live is None:
                later.append(f"{key}={want}: checked by the live diagnosis (playbook mla-path)")
    out = []
    if unmet:
        out.append(Finding(code="EXPECTATION_UNMET", severity=Severity.FAIL,
                           summary="inventory expectations not met: " + "; ".join(unmet), evidence=unmet,
                           action="fix the host, or the expectation in the inventory"))
    if met:
        out.append(Finding(code="EXPECTATIONS_MET", severity=Severity.INFO, summary="met: " + "; ".join(met),
                           evidence=met))
    if later:
        out.append(Finding(code="EXPECTATION_NOT_CHECKED", severity=Severity.INFO, summary="; ".join(later),
                           evidence=later))
    return out
