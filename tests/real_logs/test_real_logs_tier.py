"""The real-log tier: every log of tests/fixtures/real_logs (copied verbatim from public issues, labelled by
reading, by another hand than the reader's) read with the one reader, field by field.

It prints the per-field accuracy table and asserts that every field is right, or that the miss is listed in
KNOWN_LIMITS with its reason. A listed miss that the reader now gets right fails too (remove it): the list
never hides a regression or an improvement. No label is changed here to fit the reader.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import yaml

from mla_doctor.diagnosis.log_normalise import clean_line
from mla_doctor.diagnosis.log_reading import read_log, split_record

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "real_logs"
FIELDS = ("engine", "decode_backend", "prefill_backend", "cudagraph_mode", "cudagraph_mode_requested", "sparse",
          "fatal", "other_backends", "died", "death_kind", "shutdown")
# labels the corpus added with the process-life model (issue 29): graded only where an entry has them
LIFE_FIELDS = ("died", "death_kind", "shutdown")

# (log file prefix, field) -> why the reader's answer differs from the label. Kinds of limits, not tuning.


def _by_name(model: str) -> str:
    return ("the model is named only outside the paste (%s): no line of the paste names the model, its architecture "
            "or a backend, so a reader of the paste alone cannot tell its family (the label states what ran)"
            % model)


_V0_EAGER = ("enforce_eager=True read as NONE (no CUDA graphs ran) on a V0 engine line; the label keeps V0 logs' "
             "CUDA-graph mode null because V0 has no V1 mode names (a policy difference: both say no graphs ran)")
_DRAFTER_AFTER = ("the drafter's phase is known only from a line that starts it (loading the draft / EAGLE model) "
                  "BEFORE a selection line; here the only drafter evidence ('Detected EAGLE model ...') comes after "
                  "the selection line, so it is read as the model's")


KNOWN_LIMITS: Dict[Tuple[str, str], str] = {
    ('002-', 'engine'):
        "V0 only by era: the un-bracketed 'worker_base.py:145]' prefix and a RayWorkerWrapper tag are printed"
        ' by both engines of 0.4-0.7; the label reads the release default, which the reader never passes off '
        'as read',
    ('002-', 'sparse'): _by_name("DeepSeek-V2; 'deepseek' is only a conda environment's directory in a path"),
    ('003-', 'engine'):
        "V1 inferred from compilation_config level 3 + splitting_ops being 0.8's V1 defaults: a default, not "
        'a line that only V1 prints',
    ('003-', 'cudagraph_mode'):
        "PIECEWISE inferred from 0.8 V1's defaults (use_cudagraph true, no mode name in 0.8); no line states "
        'the mode',
    ('003-', 'sparse'): _by_name('DeepSeek-R1'),
    ('006-', 'sparse'):
        'the reader reads a dense model backend selection (TRITON_MLA) as not sparse; the label leaves it '
        "null because this PR build may run GLM-5.1's DSA layers on TRITON_MLA (a fork-specific doubt the log"
        ' does not state)',
    ('016-', 'sparse'):
        "the model is named only by the container's name in a 'docker logs' prompt (a name the user chose, not a "
        "line vLLM logged: DeepSeek-R1-Distill-Llama, a Llama): the reader takes a model's name only from vLLM's "
        "own lines or the command that ran it",
    ('020-', 'sparse'): _by_name('Kimi-VL'),
    ('047-', 'sparse'): _by_name('DeepSeek-R1 (from the title)'),
    ('052-', 'sparse'): _by_name('DeepSeek-R1-0528 (the version only in the title)'),
    ('053-', 'decode_backend'):
        "the project's canonical enum names drop 0.7-0.9's _VLLM_V1 suffix (knowledge backend_aliases: "
        "TRITON_MLA_VLLM_V1 -> TRITON_MLA), so the backend's knowledge entry is found; the label keeps the "
        "release's own spelling TRITON_ATTN_VLLM_V1",
    ('057-', 'sparse'): _by_name('openPangu-Ultra-MoE (from the PR)'),
    ('059-', 'sparse'): _by_name('DeepSeek-R1 (from the title)'),
    ('061-', 'sparse'): _by_name('DeepSeek-R1 (from the title)'),
    ('062-', 'sparse'): _by_name('DeepSeek-R1-0528 (from the title)'),
    ('007-', 'decode_backend'):
        'FLASHINFER_MLA_SPARSE_DSV4 is named only by the exception its own constructor raised: the reader reports '
        'it as crashed_backend, never as the selected backend (no selection line is in the paste)',
    ('039-', 'decode_backend'):
        "ROCM_AITER_MLA is known only from the crashing traceback's frames (rocm_aiter_mla.py): reported as "
        'crashed_backend, not as a selection',
    ('040-', 'decode_backend'):
        "'Aiter MLA only supports 16 or 128 number of heads' names the backend only in its crash: reported as "
        'crashed_backend, not as a selection',
    ('058-', 'engine'):
        'V1 only because release 0.25 has no V0: the reader takes the engine from lines only, never from the '
        "release (the verdict and `explain` apply the release's default and say so)",
    ('064-', 'engine'):
        "pytest -v output of several parametrized unit tests, read as one server's log: the reader has no "
        "notion of 'no server here', so the V1 selection lines decide (the label: no engine runs)",
    # ---- issue 29's grown corpus
    ('079-', 'sparse'): _by_name('Gemma 3 (from the title)'),
    ('080-', 'sparse'): _by_name('Command A (from the title)'),
    ('086-', 'sparse'): _by_name('DeepSeek (from the title); 0.7.1 is only a directory name in a frame\'s path'),
    ('099-', 'sparse'): _by_name('gpt-oss (from the title)'),
    ('103-', 'sparse'): _by_name('Llama 4 (from the title)'),
    ('083-', 'died'):
        "the engine core's failure shows only as the tail of its error message (tagged lines without a level, "
        "no traceback, no exception line); the only traceback is the API server's own (cut), so the reader "
        "names the API server. The label reads which process failed first from the message's content",
    ('093-', 'decode_backend'): _DRAFTER_AFTER,
    ('093-', 'other_backends'): _DRAFTER_AFTER,
    ('093-', 'sparse'):
        "follows from the drafter's backend read as the model's (FLASH_ATTN: dense); " + _DRAFTER_AFTER,
    ('115-', 'sparse'): _by_name('GLM-4.5V (from the title)'),
    ('116-', 'sparse'): _by_name('DeepSeek-R1 (from the title)'),
    ('121-', 'sparse'): _by_name('Gemma 3n (from the PR)'),
    ('144-', 'sparse'): _by_name("Qwen 3 30B Coder, in the issue's details summary"),
    ('120-', 'cudagraph_mode'): _V0_EAGER,
    ('097-', 'cudagraph_mode'): _V0_EAGER,
    ('064-', 'decode_backend'):
        "the same pytest output: two tests' selection lines, the last one taken as the model's (the label: no"
        ' single server, null)',
}


def _index() -> List[dict]:
    path = ROOT / "index.yaml"
    if not path.exists():
        pytest.fail("tests/fixtures/real_logs/index.yaml is missing: the real-log corpus is part of the repo")
    entries = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(entries, list) and entries, "index.yaml holds no entries"
    return entries


def _msg(text: Optional[str]) -> str:
    """A fatal label or line compared as the reader sees both: wrappers stripped, whitespace folded."""
    if not text:
        return ""
    body, _tags, _pid = clean_line(str(text))
    return re.sub(r"\s+", " ", split_record(body)[0]).strip()


def _same_fatal(label: str, got: Optional[str]) -> bool:
    a, b = _msg(label), _msg(got)
    return bool(a and b) and (a in b or b in a or a[:60] == b[:60])


def read(entry: dict) -> Dict[str, Any]:
    lines = (ROOT / entry["file"]).read_text(encoding="utf-8", errors="replace").splitlines()
    r = read_log(lines)
    return {
        "engine": r.engine,
        "decode_backend": r.attention_backend.value if r.attention_backend else None,
        "prefill_backend": r.prefill_backend.value if r.prefill_backend else None,
        "cudagraph_mode": r.cudagraph_mode,
        "cudagraph_mode_requested": r.cudagraph_mode_requested,
        "sparse": r.sparse,
        # the line that says WHY the server died (the cause, never the wrapper when the paste has the cause)
        "fatal": r.fatal_cause.text if r.fatal_cause is not None else None,
        "other_backends": sorted((f.role, f.value) for f in r.other_backends),
        "died": r.died,
        "death_kind": r.death_kind,
        "shutdown": r.shutdown,
    }


def compare(field: str, label: Any, got: Any, labels: dict) -> Optional[bool]:
    """True/False: right/wrong; None: the label does not grade this field."""
    if field == "cudagraph_mode_requested":
        if "cudagraph_mode_requested" not in labels:
            return None   # labelled only where it differs from the mode that ran
        return label == got
    if field in LIFE_FIELDS and field not in labels:
        return None
    if field == "shutdown":
        return bool(label) == bool(got)
    if field == "fatal":
        return got is None if not label else _same_fatal(label, got)
    if field == "other_backends":
        if not all(isinstance(o, dict) for o in label or []):
            return False   # a label not in the schema's shape (test_every_label_is_in_the_schemas_shape says which)
        want = sorted((str(o.get("role")), o.get("backend")) for o in label or [])
        return want == got
    return label == got


def grade() -> Tuple[Dict[str, List[int]], List[Tuple[str, str, Any, Any]]]:
    table = {f: [0, 0] for f in FIELDS}
    misses: List[Tuple[str, str, Any, Any]] = []
    for entry in _index():
        labels = entry.get("labels") or {}
        got = read(entry)
        for field in FIELDS:
            ok = compare(field, labels.get(field), got[field], labels)
            if ok is None:
                continue
            table[field][1] += 1
            if ok:
                table[field][0] += 1
            else:
                misses.append((entry["file"], field, labels.get(field), got[field]))
    return table, misses


def _limit(file: str, field: str) -> Optional[str]:
    return next((why for (pre, f), why in KNOWN_LIMITS.items() if f == field and file.startswith(pre)), None)


def test_every_indexed_log_is_there_and_every_log_indexed():
    entries = _index()
    files = {e["file"] for e in entries}
    assert len(files) == len(entries), "a log is indexed twice"
    on_disk = {p.name for p in ROOT.glob("*.log")}
    assert files == on_disk, "index.yaml and the .log files differ: %s" % sorted(files ^ on_disk)
    for e in entries:
        src = e.get("source", "")
        # a public paste names its URL; a log recorded here names the script (in the tree) that recorded it
        recorded = re.match(r"recorded: (tests/support/\S+\.py) ", src)
        assert src.startswith("https://") or (recorded and (ROOT.parents[1] / recorded.group(1)[6:]).is_file()), \
            "%s: no source URL, nor a recording script of the tree" % e["file"]


_SHAPES = {"died": (None, "api_server", "engine_core", "worker", "unknown"),
           "death_kind": (None, "exception", "signal", "oom", "abort"), "shutdown": (True, False)}


def test_every_label_is_in_the_schemas_shape():
    """The labels the corpus and the reader agreed on (tests/fixtures/real_logs/README.md): a label in another
    shape would be graded wrong whatever the reader reads."""
    bad = []
    for e in _index():
        labels = e.get("labels") or {}
        for o in labels.get("other_backends") or []:
            if not (isinstance(o, dict) and o.get("role") and "backend" in o):
                bad.append((e["file"], "other_backends", o))
        for key, allowed in _SHAPES.items():
            if key in labels and labels[key] not in allowed:
                bad.append((e["file"], key, labels[key]))
        if labels.get("shutdown") and (labels.get("died") or labels.get("fatal")):
            bad.append((e["file"], "shutdown", "a requested shutdown with a death: died/fatal must be null"))
    assert not bad, "labels outside the schema: %s" % bad


def test_per_field_accuracy_on_the_real_logs(capsys):
    table, misses = grade()
    lines = ["", "field                      right / graded"]
    for field, (ok, n) in table.items():
        lines.append("%-26s %3d / %-3d  %5.1f%%" % (field, ok, n, 100.0 * ok / n if n else 100.0))
    all_ok = sum(ok for ok, _n in table.values())
    all_n = sum(n for _ok, n in table.values())
    lines.append("%-26s %3d / %-3d  %5.1f%%" % ("all fields", all_ok, all_n, 100.0 * all_ok / max(1, all_n)))
    logs = len(_index())
    wrong = {f for f, _fld, _w, _g in misses}
    lines.append("%-26s %3d / %-3d  %5.1f%%" % ("logs fully right", logs - len(wrong), logs,
                                                 100.0 * (logs - len(wrong)) / max(1, logs)))
    explained = [(f, fld, want, got, _limit(f, fld)) for f, fld, want, got in misses]
    for f, fld, want, got, why in explained:
        lines.append("  miss %-52s %-24s label=%r read=%r%s" % (f[:52], fld, want, got,
                                                                 "" if why else "   <-- NOT EXPLAINED"))
    with capsys.disabled():
        print("\n".join(lines))
    # the done-when's bounds, asserted where reached (a regression fails here too, not only in the list below):
    # labelled fields >= 95 % is reached; logs fully right is not (90 % wanted): its floor is the measured 116/146,
    # 17 of the 30 logs missed only for a model named outside the paste (KNOWN_LIMITS says which, and why)
    assert all_ok >= 0.95 * all_n, "labelled fields right fell below 95%%: %d / %d" % (all_ok, all_n)
    assert logs - len(wrong) >= 0.79 * logs, "logs fully right fell below 79%%: %d / %d" % (logs - len(wrong), logs)
    unexplained = [(f, fld, want, got) for f, fld, want, got, why in explained if not why]
    assert not unexplained, "misses that are not a known limit: %s" % unexplained
    missed = {(f, fld) for f, fld, _w, _g in misses}
    stale = [(pre, fld) for pre, fld in KNOWN_LIMITS
             if not any(f.startswith(pre) and fl == fld for f, fl in missed)]
    assert not stale, "known limits the reader now gets right (remove them): %s" % stale
