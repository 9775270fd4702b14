"""The lines of a long log the reader can leave out, and what leaving them out must still count. Pure.

Most of a long paste is lines nothing reads a fact from (request, metrics, loading chatter). Reading each through
the normaliser, the formats and every rule costs ~60 us a line; this module finds, in about 2 us a line, the
*quiet* ones, which the reader skips and only counts:

* a quiet line is a plain vLLM INFO/DEBUG record as the normaliser itself reads it (no launcher, time, tag,
  colour, glue or prompt around it, never cut or wrapped), in which no format's head, none of the reader's own
  patterns (every compiled regex of ``log_facts``, ``log_life``, ``log_runs``, the markers, the run starts, the
  version and exception lines) and none of the string literals its rules test a message with can be, from no
  logger file a rule knows. It is decided once per *class*: the line with every digit read as ``0``
  (``SIGMA``); the filler of a long paste (``shard 41 of 500``) is a handful of classes. Each rule pattern is
  tested in a *relaxed* form (a digit literal, or a class naming some digits, reads any digit; a negative
  assertion naming digits is dropped), which matches the class's line wherever the pattern could match one of
  its lines; the normaliser's patterns already read all digits alike (checked, else nothing is left out). So
  the answer decided for the class is exact for every line in it;
* only lines inside a run of quiet lines, at least MARGIN lines from its ends, are left out: every rule that
  looks at neighbours (a traceback's next records, the line before an ERROR, the process's next 400 records)
  sees exactly the records it saw before.

The reader then adds what the left-out lines would have added: records, unmatched lines, each process's line
count, the line widths its wrap detection counts, the matcher's step budget (``Skipped``).
"""
from __future__ import annotations

import ast
import bisect
from collections import Counter
from itertools import accumulate
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Pattern, Sequence, Tuple

from mla_doctor.diagnosis import log_facts, log_life, log_runs
from mla_doctor.diagnosis.log_normalise import _GLUED, _LEVEL_START, _PROMPT, MAX_LINE, clean_line, split_record

try:   # the regex parser and compiler (3.11+: re._parser; 3.9/3.10: sre_parse, as the re module itself uses)
    from re import _compiler as _sre_compile  # type: ignore[attr-defined]
    from re import _constants as _sre_const  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:   # pragma: no cover - Python < 3.11
    import sre_compile as _sre_compile  # type: ignore[no-redef]
    import sre_constants as _sre_const  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

__all__ = ["SIGMA", "MARGIN", "MIN_LINES", "Skipped", "Plan", "plan", "relax", "triggers"]

MIN_LINES = 20_000   # a shorter log is read whole: the triggers' set-up (~30 ms) would not pay
MARGIN = 512         # quiet lines kept at each end of a quiet run: more than any window a rule looks through
                     # (log_life reads a death's next 400 records; tests/unit/test_log_prefilter.py)
SIGMA = str.maketrans("123456789", "000000000")
_SIGMA_BYTES = bytes.maketrans(b"123456789", b"000000000")
_DIGITS = set(range(0x30, 0x3A))


# --------------------------------------------------------------------------- the reader's own patterns, relaxed

def _digit_cover(items: list) -> Optional[set]:
    """The digits a character class names (None: a construct not read here)."""
    got: set = set()
    c = _sre_const
    for op, av in items:
        if op is c.NEGATE:
            return None
        if op is c.LITERAL:
            got |= {av} & _DIGITS
        elif op is c.RANGE:
            got |= set(range(av[0], av[1] + 1)) & _DIGITS
        elif op is c.CATEGORY:
            if av in (c.CATEGORY_DIGIT, c.CATEGORY_WORD, c.CATEGORY_NOT_SPACE, c.CATEGORY_UNI_DIGIT,
                      c.CATEGORY_UNI_WORD, c.CATEGORY_UNI_NOT_SPACE):
                got |= _DIGITS
        else:
            return None
    return got


def _relax(sub: Any, dry: bool = False) -> bool:
    """Make the parsed pattern read every digit alike, matching at least what it matched (in place; ``dry``:
    only say whether it already does). A negative assertion that names some digits is dropped (the pattern
    then matches more). False where it cannot be done (a back-reference, a negated class naming some digits)."""
    c = _sre_const
    data = sub.data if hasattr(sub, "data") else sub
    drop = []
    for i, (op, av) in enumerate(data):
        if op is c.LITERAL or op is c.NOT_LITERAL:
            if av in _DIGITS:
                if dry or op is c.NOT_LITERAL:
                    return False
                data[i] = (c.IN, [(c.CATEGORY, c.CATEGORY_DIGIT)])
        elif op is c.IN:
            negated = any(o is c.NEGATE for o, _a in av)
            got = _digit_cover([x for x in av if x[0] is not c.NEGATE])
            if got is None:
                return False
            if got and got != _DIGITS:
                if dry or negated:
                    return False
                data[i] = (c.IN, list(av) + [(c.CATEGORY, c.CATEGORY_DIGIT)])
        elif op in (c.ANY, c.AT):
            continue
        elif op is c.SUBPATTERN:
            if not _relax(av[-1], dry):
                return False
        elif op is c.BRANCH:
            if not all(_relax(b, dry) for b in av[1]):
                return False
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT) or getattr(op, "name", "") == "POSSESSIVE_REPEAT":
            if not _relax(av[2], dry):
                return False
        elif op is c.ASSERT:
            if not _relax(av[1], dry):
                return False
        elif op is c.ASSERT_NOT:
            if not _relax(av[1], True):
                if dry:
                    return False
                drop.append(i)
        elif getattr(op, "name", "") == "ATOMIC_GROUP":
            if not _relax(av, dry):
                return False
        else:
            return False
    for i in reversed(drop):
        del data[i]
    return True


def relax(rx: Pattern[str]) -> Optional[Pattern[str]]:
    """``rx`` reading every digit alike (``rx`` matches a line => the relaxed one matches it with its digits as
    0); None where that cannot be built."""
    try:
        tree = _sre_parse.parse(rx.pattern, rx.flags)
        if not _relax(tree):
            return None
        return _sre_compile.compile(tree, rx.flags)
    except Exception:   # noqa: BLE001 - an internal API that moved: the pattern counts as matching everything
        return None


def _patterns(obj: Any, depth: int = 0) -> Iterable[Pattern[str]]:
    if isinstance(obj, re.Pattern):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _patterns(x, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for x in obj.values():
            yield from _patterns(x, depth + 1)


def _inline_patterns(path: Path) -> Iterable[Tuple[str, bool]]:
    """(pattern, case-blind) of the regexes a module's code writes in place: ``re.search(r"...", text)`` (any
    flag given is read as IGNORECASE, which matches at least as much; a line holds no newline for S or M)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" \
                and node.func.attr in ("search", "match", "fullmatch", "findall", "finditer", "compile") \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            yield node.args[0].value, len(node.args) > 2 or (node.func.attr == "compile" and len(node.args) > 1) \
                or any(k.arg == "flags" for k in node.keywords)


def _literals(path: Path) -> Iterable[str]:
    """The strings a module's rules test text with: ``"x" in s``, ``s == "x"``, ``s.startswith("x")``."""
    def strs(node: Any) -> List[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [s for e in node.elts for s in strs(e)]
        return []

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.In, ast.NotIn)):
                    yield from strs(node.left)
                elif isinstance(op, (ast.Eq, ast.NotEq)):
                    yield from strs(node.left) + strs(right)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith"):
            for a in node.args:
                yield from strs(a)


def _rule_literals() -> Tuple[Tuple[str, ...], Tuple[Tuple[str, bool], ...]]:
    """(the rules' literals as SIGMA reads them, the patterns their code writes in place); parsed once per version
    of the rule modules (~20 ms), kept in the knowledge cache by the sources' digest. One-character literals are
    tested on names (a display name's space) or after a pattern matched ("V"), never alone on a message."""
    import hashlib

    from mla_doctor import user_cache

    paths = [Path(mod.__file__) for mod in RULE_MODULES] + [Path(__file__)]
    try:
        digest = hashlib.sha256(b"\0".join(p.read_bytes() for p in paths)).hexdigest()[:32]
    except OSError:
        digest = None

    def build() -> Tuple[Tuple[str, ...], Tuple[Tuple[str, bool], ...]]:
        return (tuple(sorted({s.translate(SIGMA) for p in paths[:-1] for s in _literals(p) if len(s) > 1})),
                tuple(sorted({x for p in paths[:-1] for x in _inline_patterns(p)})))

    if digest is None:
        return build()
    got = user_cache.pickled("knowledge", "MLA_DOCTOR_KNOWLEDGE_CACHE", f"log-rule-literals-{digest}", build)
    return tuple(got[0]), tuple(tuple(x) for x in got[1])


# the modules whose rules read a record's message or logger (log_facts' and log_life's rules, log_runs' starts)
RULE_MODULES = (log_facts, log_life, log_runs)


@dataclass
class Triggers:
    patterns: List[Pattern[str]]      # relaxed
    sources: List[Pattern[str]]       # as the rules have them
    literals: Tuple[str, ...]         # as SIGMA reads them
    files: frozenset                  # logger file names a rule knows (SIGMA-read)
    exact: bool                       # every pattern could be relaxed (else a line no pattern was read for is
                                      # never quiet)


@functools.lru_cache(maxsize=4)
def triggers(extra: Tuple[Pattern[str], ...] = ()) -> Triggers:
    """What can make a line matter to the reader: its patterns, relaxed, and the literals its rules test."""
    markers = log_facts.load_markers()
    found: List[Pattern[str]] = list(extra)
    for mod in RULE_MODULES:
        found += [p for v in vars(mod).values() for p in _patterns(v)]
    found += list(_patterns(markers)) + [rx for _sid, _kind, rx in log_runs.load_run_starts()]
    lits, inline = _rule_literals()
    for text, blind in inline:
        try:
            found.append(re.compile(text, re.IGNORECASE if blind else 0))
        except re.error:
            return Triggers([], [], (), frozenset(), False)
    seen, relaxed, exact = set(), [], True
    for rx in found:
        if (rx.pattern, rx.flags) in seen:
            continue
        seen.add((rx.pattern, rx.flags))
        got = relax(rx)
        if got is None:
            exact = False
        else:
            relaxed.append(got)
    files = set(log_life._WHERE) | set(log_facts._logger_files(markers))
    return Triggers(relaxed, list(found), tuple(lits), frozenset(f.translate(SIGMA) for f in files), exact)


# --------------------------------------------------------------------------- the formats' heads, by SIGMA

@dataclass
class Heads:
    grams: Dict[str, List[str]] = field(default_factory=dict)   # SIGMA(head[:4]) -> SIGMA(head)s


def heads_index(heads: Iterable[str]) -> Heads:
    out = Heads()
    for h in heads:
        s = h.translate(SIGMA)
        out.grams.setdefault(s[:4], []).append(s)
    return out


def _any_head(text: str, idx: Heads) -> bool:
    """A format's head could be in a line whose SIGMA is ``text`` (a format matches only a message holding its
    head: Matcher.match)."""
    grams = idx.grams
    for i in range(len(text) - 3):
        got = grams.get(text[i:i + 4])
        if got and any(h in text for h in got):
            return True
    return False


# --------------------------------------------------------------------------- the plan

@dataclass
class Skipped:
    """The lines left out, in line order: their numbers, message lengths and widths."""
    ns: List[int] = field(default_factory=list)
    msg_chars: List[int] = field(default_factory=list)   # cumulative: msg_chars[i] = sum of the first i+1
    widths: List[int] = field(default_factory=list)

    def between(self, lo: int, hi: int) -> Tuple[int, int]:
        """(first, end) indexes of the skipped lines numbered lo..hi."""
        return bisect.bisect_left(self.ns, lo), bisect.bisect_right(self.ns, hi)

    def count(self, lo: int, hi: int) -> int:
        a, b = self.between(lo, hi)
        return b - a

    def chars(self, a: int, b: int) -> int:
        """Message characters of skipped lines [a, b)."""
        if b <= a:
            return 0
        return self.msg_chars[b - 1] - (self.msg_chars[a - 1] if a else 0)

    def width_counts(self, a: int, b: int) -> Dict[int, int]:
        return {w: c for w, c in Counter(self.widths[a:b]).items() if w >= 60}


@dataclass
class Plan:
    kept: List[dict]
    skipped: Skipped


MAX_CLASSES = 20_000   # more distinct lines (digits aside) than this: the log is not a long run of a few kinds


@functools.lru_cache(maxsize=1)
def _normaliser_uniform() -> bool:
    """Every pattern of the normaliser and the record grammar reads all digits alike (as the triggers do once
    relaxed), so a class's line with its digits as 0 is normalised as each of its lines is."""
    from mla_doctor.diagnosis import log_normalise

    for rx in _patterns(list(vars(log_normalise).values())):
        try:
            if not _relax(_sre_parse.parse(rx.pattern, rx.flags), True):
                return False
        except Exception:   # noqa: BLE001 - the parser moved: nothing is left out
            return False
    return True


def _class_quiet(line: str, tr: Triggers, idx: Sequence[Heads]) -> Optional[Tuple[int, int]]:
    """(message length, line length) of the lines of this class (``line``: one of them with every digit as 0)
    when they are quiet, else None."""
    # a record of its own (its level opens it: never a wrapped line's tail), as the normaliser leaves it
    if len(line) > MAX_LINE or not _LEVEL_START.match(line) or clean_line(line) != (line, (), None):
        return None
    msg, level, where = split_record(line)
    if level not in ("INFO", "DEBUG") or not line.startswith(level) or not where or not msg \
            or not line.endswith(msg) or len(_GLUED.split(line, maxsplit=2)) != 1 or _PROMPT.match(line):
        return None
    if where.rsplit("/", 1)[-1].split(":", 1)[0] in tr.files:
        return None
    # the message, the logger, and the whole line after its level word (a rule reads a record's text too: the
    # engine markers at "text"); no rule pattern names a level word (tests/unit/test_log_prefilter.py)
    for text in (msg, where, line[len(level):]):
        if any(lit in text for lit in tr.literals) or any(rx.search(text) for rx in tr.patterns):
            return None
    if any(_any_head(msg, i) for i in idx):
        return None
    return len(msg), len(line)


def plan(lines: Sequence[Any], heads: Sequence[Heads], extra: Tuple[Pattern[str], ...] = ()) -> Optional[Plan]:
    """The lines (strings, or ``{"n", "text"}`` numbered in increasing order) to read, as ``{"n", "text"}``, and
    the quiet ones left out; None when nothing is left out (a short log, no long quiet run, a pattern that could
    not be read digit-blind)."""
    if len(lines) < MIN_LINES:
        return None
    if isinstance(lines[0], dict):
        try:
            ns = [it["n"] for it in lines]
            texts = [it["text"] for it in lines]
        except (KeyError, TypeError):
            return None
        if set(map(type, ns)) != {int} or set(map(type, texts)) != {str} or ns[0] < 1 \
                or (ns != list(range(ns[0], ns[0] + len(ns))) and ns != sorted(set(ns))):
            return None   # numbered in increasing order, as a slice of a file is (what is counted is by number)
    elif set(map(type, lines)) == {str}:
        texts, ns = list(lines), list(range(1, len(lines) + 1))
    else:
        return None
    tr = triggers(tuple(extra))
    if not tr.exact or not _normaliser_uniform():
        return None
    # each line's class: its bytes with every digit as 0 (one translate of the whole text: ~20x a str.translate
    # per line); UTF-8 never puts an ASCII byte inside a character, so the classes are the str ones
    keys = "\n".join(texts).encode("utf-8", "surrogatepass").translate(_SIGMA_BYTES).split(b"\n")
    if len(keys) != len(texts):
        return None   # a line holding a newline
    classes = set(keys)
    if len(classes) > MAX_CLASSES:
        return None
    memo = {k: _class_quiet(k.decode("utf-8", "surrogatepass"), tr, heads) for k in classes}
    flags = bytes([0 if memo[k] is None else 1 for k in keys])
    msg_len = {k: v[0] for k, v in memo.items() if v is not None}
    width = {k: v[1] for k, v in memo.items() if v is not None}
    kept: List[dict] = []
    sk = Skipped()
    total, pos = 0, 0

    def keep(a: int, b: int) -> None:
        if isinstance(lines[0], dict):
            kept.extend(lines[a:b])
        else:
            kept.extend({"n": ns[i], "text": texts[i]} for i in range(a, b))

    for m in re.finditer(b"\x01{%d,}" % (2 * MARGIN + 1), flags):
        a, b = m.start() + MARGIN, m.end() - MARGIN   # a quiet run's MARGIN first and last lines are read
        keep(pos, a)
        sk.ns += ns[a:b]
        run = list(accumulate(map(msg_len.__getitem__, keys[a:b]), initial=total))
        sk.msg_chars += run[1:]
        total = run[-1]
        sk.widths += map(width.__getitem__, keys[a:b])
        pos = b
    if not sk.ns:
        return None
    keep(pos, len(lines))
    return Plan(kept, sk)
