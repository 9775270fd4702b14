"""Speed guard (issue 30): the everyday commands against their floors, as CPU ratios measured in this run
(bench/speed_ratios.py: best of a few interleaved runs, so a loaded machine inflates neither side), never
absolute times.

Hard bounds (a regression fails `make guard`):
  * a whole `static --local` process on the real vLLM 0.33.0 tree, a second audit of the release, with no model
    and with --model, and `patch --dry-run`: at most REGRESSION x the read-and-hash floor. Resolving every MLA
    architecture on every run (the resolution not taken from the controller's store) is ~30x;
  * explain's input stage on a 50 MB paste (what is kept of it, cli/explain.py): at most 1.5x the floor of
    reading the file and matching one regex per line. Reading the whole paste as lines before dropping is ~3x;
  * the whole `explain --log PASTE --format json` process on that paste: at most 5x the same floor (the issue's
    goal; measured 3.7-3.9x at load 5-8). Reading every kept line through the whole reader (no pre-filter,
    diagnosis/log_prefilter.py) is ~55x; reading the whole paste before dropping fails this bound and the one above;
  * the same on a 50 MB paste of a busy server's own lines (requests, uvicorn's access lines, the engine's metrics
    lines: tests/support/serving_log.py), which the pre-filter reads in full (each line a tagged record, from a
    logger file a rule knows, or holding words or numbers a rule's pattern reads): at most SERVING_REGRESSION x
    (measured 81-83x at load 5-6). The matcher trying every format on every line (no head index) is ~170x; the 5x
    goal there is a strict xfail.
The audit's goal (<= 2x) is not met yet: a strict xfail that names what was measured, and fails as soon as the
goal is met, so the bound is tightened then.
"""
from __future__ import annotations

import importlib.util
import re
import resource
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("speed_ratios", ROOT / "bench" / "speed_ratios.py")
sr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sr)

# what this tree achieves, with room for a loaded machine's noise (measured 3.2-3.5x without and with a model,
# 9x for patch --dry-run, at load 7-9); the regressions named above are several times over
REGRESSION = {"audit": 5.0, "audit_model": 5.0, "patch_dry_run": 12.5}
GOAL = {"audit": 2.0, "audit_model": 2.0, "patch_dry_run": 2.0}


@pytest.fixture(scope="module")
def audit_ratios(tmp_path_factory):
    from tests.support import corpus

    if not (corpus.tree_dir("vllm", sr.VERSION) / ".complete").exists():
        pytest.fail("vLLM %s sources not cached: `make unit` fetches them first" % sr.VERSION)
    got = sr.measure({"audit", "audit_model", "patch_dry_run"}, rounds=3, tmp=tmp_path_factory.mktemp("speed"))
    for name, r in got.items():
        print("%s: %.3f s / floor %.3f s = %.2fx" % (name, r["cpu_s"], r["floor_s"], r["ratio"]))
    return got


@pytest.mark.parametrize("name", sorted(REGRESSION))
def test_audit_stays_near_its_floor(audit_ratios, name):
    r = audit_ratios[name]
    assert r["ratio"] <= REGRESSION[name], "%s: %.2fx the read-and-hash floor (bound %gx): %r" % (
        name, r["ratio"], REGRESSION[name], r)


@pytest.mark.xfail(strict=True, reason="issue 30's goal, not met: ~3.2-3.5x without and with a model, ~9x for "
                                       "patch --dry-run (docs/speed.md: what is left)")
def test_audit_goal_two_times_the_floor(audit_ratios):
    over = {n: round(audit_ratios[n]["ratio"], 2) for n in GOAL if audit_ratios[n]["ratio"] > GOAL[n]}
    assert not over, over


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@pytest.fixture(scope="module")
def paste(tmp_path_factory):
    return sr.paste(tmp_path_factory.mktemp("paste") / "paste.log", 50)


def test_explain_reads_only_what_it_keeps(paste):
    """The input stage in this process, interleaved with its floor, best of 3 each."""
    from mla_doctor.cli.explain import _read_log

    pat = re.compile(rb"Using ([\w.]+) (?:attention )?backend")

    def floor():
        n = 0
        with open(paste, "rb") as f:
            for line in f:
                if pat.search(line):
                    n += 1
        return n

    best = {"read": 9e9, "floor": 9e9}
    for _ in range(3):
        for name, fn in (("floor", floor), ("read", lambda: _read_log(str(paste)))):
            t = _cpu()
            fn()
            best[name] = min(best[name], _cpu() - t)
    ratio = best["read"] / best["floor"]
    print("explain input: %.3f s / floor %.3f s = %.2fx" % (best["read"], best["floor"], ratio))
    assert ratio <= 1.5, "explain's input stage: %.2fx its floor: %r" % (ratio, best)


def test_explain_goal_five_times_the_floor(tmp_path):
    """The whole explain process on a 50 MB paste (its newest 8 MiB, ~91k lines, read), best of 3 interleaved
    runs against its floor: the reader leaves the quiet lines of the long run out (~2 us a line, not ~60)."""
    got = sr.measure({"explain"}, rounds=3, paste_mb=50, tmp=tmp_path)["explain"]
    print("explain: %.3f s / floor %.3f s = %.2fx" % (got["cpu_s"], got["floor_s"], got["ratio"]), file=sys.stderr)
    assert got["ratio"] <= 5.0, got


SERVING_REGRESSION = 120.0


@pytest.fixture(scope="module")
def serving_ratio(tmp_path_factory):
    got = sr.measure({"explain_serving"}, rounds=2, paste_mb=50, tmp=tmp_path_factory.mktemp("serving"))
    r = got["explain_serving"]
    print("explain (serving paste): %.3f s / floor %.3f s = %.2fx" % (r["cpu_s"], r["floor_s"], r["ratio"]),
          file=sys.stderr)
    return r


def test_explain_of_a_busy_servers_paste_stays_where_it_is(serving_ratio):
    """A paste that is mostly a serving server's lines is read line by line (~170 us a line of its newest 8 MiB,
    ~34k lines): bounded so it gets no worse."""
    assert serving_ratio["ratio"] <= SERVING_REGRESSION, serving_ratio


@pytest.mark.xfail(strict=True, reason="issue 30's 5x goal on a busy server's paste, not met: ~80x (its lines are "
                                       "read one by one: docs/speed.md, what is left)")
def test_explain_goal_five_times_the_floor_on_a_busy_servers_paste(serving_ratio):
    assert serving_ratio["ratio"] <= 5.0, serving_ratio
