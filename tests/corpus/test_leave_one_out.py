"""Leave-one-out (issue 28): right on the release that ships next week. For every corpus release R the audit runs
with the table FROZEN as it was before R existed — every entry whose version range starts at R or later removed
(`newest_known`, `inspected`, every `versions: ">=X..."` item and family row with X >= R) — and is compared with
the HAND-READ expectations of test_code_paths_corpus.py (layer, decode entry, prefill kind per architecture) and of
the model classification (each family's config is MLA). The answer with the frozen table must be as good as with
the full one: whatever the code says is read from R's own files, whatever the table adds is history and advice.

Cheap: one resolution per hand-read row, cached like every corpus agent answer. `python -m
tests.corpus.test_leave_one_out` prints the per-release table docs/releases.md quotes.
"""
from __future__ import annotations

import copy
import sys

import pytest
from packaging.version import Version

from mla_doctor.diagnosis import code_paths as cp
from mla_doctor.diagnosis.knowledge import DATA_FILE, Knowledge, load_data
from mla_doctor.diagnosis.static_facts import classify_model
from tests.corpus.test_code_paths_corpus import EXPECT, WRAPPED, _answer, _matches
from tests.support import corpus

pytestmark = pytest.mark.corpus

# each hand-read architecture's text config (model_type as its config.json has it; V4 configs carry
# compress_ratios and head_dim, is_deepseek_mla's V4 test)
CONFIGS = {
    "DeepseekV3ForCausalLM": {"model_type": "deepseek_v3"},
    "DeepseekV4ForCausalLM": {"model_type": "deepseek_v4", "compress_ratios": [1, 4], "head_dim": 512},
    "DeepseekV41ForCausalLM": {"model_type": "deepseek_v41", "compress_ratios": [1, 4], "head_dim": 512},
    "DeepseekV4ForConditionalGeneration": {"model_type": "deepseek_v4", "compress_ratios": [1, 4], "head_dim": 512},
    "KimiLinearForCausalLM": {"model_type": "kimi_linear"},
    "DeepseekV32ForCausalLM": {"model_type": "deepseek_v32", "index_topk": 2048},
    "GlmMoeDsaForCausalLM": {"model_type": "glm_moe_dsa", "index_topk": 2048},
    "Dots3NoteForCausalLM": {"model_type": "dots3_note"},
    "HYV4ForCausalLM": {"model_type": "hy_v4"},
    "Glm5NextForCausalLM": {"model_type": "glm5_next"},
    "MistralLarge4ForCausalLM": {"model_type": "mistral_large_4", "index_topk": 2048},
    "KimiVLForConditionalGeneration": {"model_type": "deepseek_v3"},
    "DeepseekVLV2ForCausalLM": {"model_type": "deepseek_v3"},
    "DeepSeekMTPModel": {"model_type": "deepseek_mtp"},
    "DeepSeekV4MTPModel": {"model_type": "deepseek_v4", "compress_ratios": [1, 4], "head_dim": 512},
    "KimiK3MTPModel": {"model_type": "kimi_linear"},
}


def _lower(spec) -> Version | None:
    """The lowest release a `versions` spec admits (">=0.29,<0.32" -> 0.29; "==0.33.0" -> 0.33.0)."""
    if not isinstance(spec, str):
        return None
    lows = []
    for part in spec.split(","):
        part = part.strip()
        for op in (">=", "==", "~=", ">"):
            if part.startswith(op):
                try:
                    lows.append(Version(part[len(op):].strip().rstrip(".*")))
                except ValueError:
                    pass
                break
    return max(lows) if lows else None


def _names(release: Version, spec) -> bool:
    """The item's range starts at the release or later (it was written knowing that release)."""
    low = _lower(spec)
    return low is not None and low >= release


def frozen_data(data: dict, version: str) -> dict:
    """The table as it was before `version` existed: every item whose range starts at its minor line or later
    removed, newest_known / inspected cut below it."""
    rel = Version(version)

    def walk(x):
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(i) for i in x if not (isinstance(i, dict) and _names(rel, i.get("versions")))]
        return x

    out = walk(copy.deepcopy(data))
    below = sorted(Version(x) for x in data.get("inspected", []) if Version(x) < rel)
    out["inspected"] = [str(x) for x in below]
    if below and Version(out["newest_known"]) >= rel:
        out["newest_known"] = str(below[-1])
    return out


_FULL = load_data(DATA_FILE)


def _rows(dist: str, version: str):
    return [e for e in EXPECT if e[:2] == (dist, version)] + [
        (w[0], w[1], w[2], w[3], w[6], w[7], w[8], w[9], w[10]) for w in WRAPPED if w[:2] == (dist, version)]


def _check(kb: Knowledge, dist: str, version: str, row, code: bool) -> list:
    """What the audit gets wrong on one hand-read row with this knowledge (`code`: the resolution is read, as
    every static audit does; False: the table alone, what the tool did before issue 28 for the model line)."""
    _d, _v, arch, platform, layer, layer_ref, decode, prefill, _pref = row
    res = _answer(dist, version, [arch])
    cfg = dict(CONFIGS.get(arch, {"model_type": "deepseek_v3"}), architectures=[arch], kv_lora_rank=512)
    facts = kb.for_version(version)
    wrong = []
    mc = classify_model(facts, cfg, code=res if code else None)
    if not mc.is_mla:
        wrong.append("%s: not MLA (%s)" % (arch, mc.reason))
    section = cp.code_paths_section(facts, res, cfg)
    fps = [cp.family_paths(res)[0]] if res["architectures"] else []
    served = (section or {}).get("served")
    lps = [lp for fp in fps for lp in fp.layers if platform in lp.platform.split("+") and lp.cls == layer]
    if served is None or not lps:
        wrong.append("%s [%s]: no served %s" % (arch, platform, layer))
        return wrong
    (a,) = res["architectures"]
    raw = [r for b in a["branches"] if platform in b["platform"].split("+") for r in b["layers"]
           if r["class"] == layer]
    top = [c for c in raw[0]["calls"] if not c.get("inside")]
    if "%s:%s" % (raw[0]["file"], raw[0]["line"]) != layer_ref:
        wrong.append("%s: layer at %s:%s" % (arch, raw[0]["file"], raw[0]["line"]))
    if not any(_matches(c, decode) for c in top if c["role"] in ("decode", "dispatch")):
        wrong.append("%s: decode %s not found" % (arch, decode))
    if raw[0]["prefill"] != prefill:
        wrong.append("%s: prefill %s, hand-read %s" % (arch, raw[0]["prefill"], prefill))
    return wrong


def leave_one_out(dist: str, version: str) -> dict:
    """{rows, full, frozen, frozen_table_only}: the count of hand-read rows answered right with the full table,
    with the table frozen before the release (code read), and frozen with the table alone for the model line."""
    full, frozen = Knowledge(_FULL), Knowledge(frozen_data(_FULL, version))
    rows = _rows(dist, version) + [None]
    out = {"rows": len(rows), "full": 0, "frozen": 0, "frozen_table_only": 0, "worse": []}
    for row in rows:
        if row is None:  # the generic DeepSeek V3 row, on every release
            a, b, c = (_generic(full, dist, version, True), _generic(frozen, dist, version, True),
                       _generic(frozen, dist, version, False))
        else:
            a = _check(full, dist, version, row, True)
            b = _check(frozen, dist, version, row, True)
            c = _check(frozen, dist, version, row, False)
        out["full"] += not a
        out["frozen"] += not b
        out["frozen_table_only"] += not c
        if b and not a:
            out["worse"].append(b)
    return out


RELEASES = sorted(set(corpus.ALL_RELEASES), key=lambda dv: (dv[0], Version(dv[1])))
# every release without a hand-read row still has one: DeepSeek V3 is MLA (0.7.0 defines no is_deepseek_mla:
# not MLA, grep above in test_release_facts_corpus.py) and resolves to a layer with a decode entry
NO_MLA = {"0.7.0"}


def _generic(kb: Knowledge, dist: str, version: str, code: bool) -> list:
    arch = "DeepseekV3ForCausalLM"
    res = _answer(dist, version, [arch])
    cfg = {"architectures": [arch], "model_type": "deepseek_v3", "kv_lora_rank": 512}
    mc = classify_model(kb.for_version(version), cfg, code=res if code else None)
    wrong = []
    if mc.is_mla != (version not in NO_MLA):
        wrong.append("%s: is_mla %s (%s)" % (arch, mc.is_mla, mc.reason))
    layers = [lp for a in res["architectures"] for b in a["branches"] for lp in b["layers"]]
    if version not in NO_MLA and not any(c["role"] in ("decode", "dispatch") for lp in layers for c in lp["calls"]):
        wrong.append("%s: no layer with a decode entry" % arch)
    return wrong


def test_the_freeze_removes_what_names_the_release():
    """0.34.0's frozen table is the one the tool was built with (newest 0.33.0, no KIMI_K3_KV_BALANCED_MLA);
    0.33.0's loses `>=0.33` items and its own newest_known; 0.29's loses the deepseek_v32 family row (versions
    >=0.29) and the 0.29 model types."""
    f34 = frozen_data(_FULL, "0.34.0")
    assert _FULL["newest_known"] == "0.34.0" and f34["newest_known"] == "0.33.0" and "0.34.0" not in f34["inspected"]
    assert Knowledge(f34).for_version("0.34.0").backend("KIMI_K3_KV_BALANCED_MLA") is None
    assert Knowledge(_FULL).for_version("0.34.0").backend("KIMI_K3_KV_BALANCED_MLA") is not None
    f33 = frozen_data(_FULL, "0.33.0")
    assert Version(f33["newest_known"]) < Version("0.33") and "0.33.0" not in f33["inspected"]
    k29 = Knowledge(frozen_data(_FULL, "0.29.0")).for_version("0.29.0")
    assert "dots3_note" not in k29.mla_model_types and "deepseek_v32" not in {f["name"] for f in k29.families}
    assert "dots3_note" in Knowledge(_FULL).for_version("0.29.0").mla_model_types


@pytest.mark.parametrize("dist, version", [pytest.param(d, v, id="%s-%s" % (d, v)) for d, v in RELEASES])
def test_leave_one_out_is_never_worse(dist, version):
    got = leave_one_out(dist, version)
    assert not got["worse"], got
    assert got["frozen"] == got["rows"], got  # every hand-read row right on a release the table never saw


def main() -> int:
    print("| release | rows (hand-read + generic) | full table | table frozen before it | frozen, model line from "
          "the table alone |")
    print("|---|---|---|---|---|")
    for d, v in RELEASES:
        r = leave_one_out(d, v)
        print("| %s %s | %d | %d | %d | %d |" % (d, v, r["rows"], r["full"], r["frozen"], r["frozen_table_only"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
