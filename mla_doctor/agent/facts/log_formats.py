"""Log formats read from vLLM's own sources: the zero-patch evidence's vocabulary, per release.

``harvest_source(text, rel)`` parses one module with ``ast`` and returns the format strings of its
logger calls (``logger.info/debug/warning/error/fatal/..._once("...%s...", ...)``), of the messages its
``raise`` statements build, and of the strings returned by its log-message helpers (vLLM's MoE oracles
build their "Using ... backend" lines in ``_make_log_backend``), each with its line. f-strings and
``str.format`` templates are reduced to their literal parts with ``{expr}`` placeholders (a literal
``%`` doubled), so every format reads the same way: ``%s``/``%d``/``{...}`` are placeholders.

Only formats that say something about the attention path are kept (``KEYWORDS``): the attention,
prefill, MoE and KV-cache backend lines (MoE and KV-cache lines are kept so that they can be told apart
from the attention backend), the engine, CUDA graphs and eager mode, chunked prefill, MLA and sparse
decisions, and fatal conditions. ``harvest_tree(vllm_dir)`` walks the modules that hold them
(``MODULES``). Stdlib only, Python 3.8+: it runs on a host as part of the agent, and the controller's
generator (``tools/gen_log_formats.py``) runs it over every release of the corpus.
"""
from __future__ import annotations

import ast
import hashlib
import os
import re

from ..common import ScanBudget, read_static

__all__ = ["KEYWORDS", "MODULES", "PREFIX", "compact", "expand", "harvest_source", "harvest_text", "harvest_tree",
           "literal_text", "module_wanted", "order"]

# The words that make a format worth keeping (matched on its literal text, lower-cased). Each one is
# here because a line that carries it decides or reveals part of the path:
KEYWORDS = (
    "backend",            # attention / MLA prefill / MoE / KV-cache / vision backend choices
    "attention",          # selector decisions, "No valid attention backend", vit attention
    "mla",                # MLA enabled/disabled, MLA impl and prefill choices
    "sparse",             # DSA: sparse MLA, indexer, top-k MQA only
    "index_topk", "top-k", "topk",
    "engine",             # "Initializing a V1 LLM engine (v%s)", engine core death
    "cudagraph", "cuda graph", "graph capturing", "eager",
    "chunked prefill", "chunked-prefill", "prefill",
    "kv cache", "kv-cache",
    "server version",     # "vLLM API server version %s": the release in the log
    "dead", "no valid",   # fatal conditions
)

# Module prefixes (relative to vllm/) that hold those lines in some release: platforms, the attention
# selector and backends (old and v1 trees), the MLA layer and other layers (MoE oracles, quantization:
# the look-alike "Using ... backend" lines), the model config hooks of DSA/MLA models, config, engine
# core, workers (CUDA-graph capture), compilation, executors and entrypoints.
MODULES = (
    "platforms/", "attention/", "v1/attention/", "model_executor/layers/attention", "model_executor/layers/mla.py",
    "model_executor/layers/sparse", "model_executor/layers/deepseek", "model_executor/layers/fused_moe/",
    "model_executor/layers/quantization/", "model_executor/models/config.py", "model_executor/models/deepseek",
    "models/deepseek", "config/", "config.py", "engine/", "v1/engine/", "entrypoints/launcher.py",
    "entrypoints/api_server.py", "entrypoints/openai/api_server.py", "entrypoints/cli/serve.py", "worker/",
    "v1/worker/gpu_model_runner.py", "v1/worker/cpu_model_runner.py", "v1/worker/gpu/", "compilation/",
    "executor/", "v1/executor/", "envs.py",
)

_LEVELS = frozenset(("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal",
                     "debug_once", "info_once", "warning_once", "error_once"))
_PLACEHOLDER = re.compile(r"%%|%[-+ #0]*\d*(?:\.\d+)?[sdifrx]|\{[^{}]*\}")


def literal_text(fmt):
    """The format with its placeholders removed: what must appear verbatim in a log line."""
    return _PLACEHOLDER.sub(lambda m: "%" if m.group() == "%%" else "", fmt)


def _expr_name(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _expr_name(node.value)
        return (inner + "." if inner else "") + node.attr
    if isinstance(node, ast.Call):
        inner = _expr_name(node.func)
        return inner + "()" if inner else ""
    if isinstance(node, ast.Subscript):
        inner = _expr_name(node.value)
        return inner + "[]" if inner else ""
    return ""


def _str_value(node):
    """The value of a str constant (Python 3.8's ast.Str is an ast.Constant from 3.8 on)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _template(node):
    """A format string from an expression: a str constant (%-style kept), an f-string or a
    ``"...".format(...)`` call (placeholders ``{...}``, literal ``%`` doubled), a ``"..." % args``
    (the left side), or a concatenation of those. None when the text is not static."""
    s = _str_value(node)
    if s is not None:
        return s
    if isinstance(node, ast.JoinedStr):
        out = []
        for v in node.values:
            lit = _str_value(v)
            if lit is not None:
                out.append(lit.replace("%", "%%"))
            elif isinstance(v, ast.FormattedValue):
                out.append("{%s}" % _expr_name(v.value))
        return "".join(out)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return _template(node.left)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else "{}") + (right if right is not None else "{}")
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"
            and _str_value(node.func.value) is not None):
        return _str_value(node.func.value).replace("%", "%%")
    return None


def _is_logger(func):
    """``logger.info(...)``, ``self.logger.warning_once(...)``, ``_logger.debug(...)``."""
    if not isinstance(func, ast.Attribute) or func.attr not in _LEVELS:
        return False
    recv = _expr_name(func.value).lower()
    return "log" in recv.rsplit(".", 1)[-1]


def _wanted(fmt):
    text = literal_text(fmt).lower()
    return len(text.strip()) >= 8 and any(k in text for k in KEYWORDS)


def _exc_name(node):
    if isinstance(node, ast.Call):
        node = node.func
    name = _expr_name(node)
    return name.rsplit(".", 1)[-1] if name else ""


def _unique(records):
    """The records in source order, one per (line, format): a site found twice counts once."""
    seen, uniq = set(), []
    for rec in sorted(records, key=lambda r: (r["line"], r["level"], r["format"])):
        key = (rec["line"], rec["format"])
        if key not in seen:
            seen.add(key)
            uniq.append(rec)
    return uniq


def harvest_source(text, rel):
    """Format strings of ``rel`` (a path relative to ``vllm/``) that announce the attention path.

    Returns ``[{"file", "line", "level", "format"}]`` (plus ``"exc"`` for a raised exception), ordered by
    line; ``level`` is the logger method without ``_once``, ``"raise"``, or ``"return"`` for a string a
    log-message helper returns. A module that does not parse gives ``[]``."""
    try:
        tree = ast.parse(text, rel)
    except (SyntaxError, ValueError):
        return []
    out = []

    def add(node, level, fmt, exc=None):
        if fmt is None or not _wanted(fmt):
            return
        rec = {"file": rel, "line": node.lineno, "level": level, "format": fmt}
        if exc is not None:
            rec["exc"] = exc
        out.append(rec)

    helpers = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "log" in node.name.lower():
            helpers.add(node)
    for fn in helpers:
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Return) and sub.value is not None:
                add(sub, "return", _template(sub.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_logger(node.func) and node.args:
            level = node.func.attr[:-5] if node.func.attr.endswith("_once") else node.func.attr
            add(node, level, _template(node.args[0]))
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            add(node, "raise", _template(node.exc.args[0]), exc=_exc_name(node.exc))
    return _unique(out)


# --------------------------------------------------------------------------- the fast path (on a host)
#
# Parsing every module whole costs seconds of CPU (13 MB of sources in 0.33). ``harvest_text`` gives the same
# records by parsing only the statements that can hold one: a logger call, a ``raise`` or a log-message
# helper whose nearby text carries a keyword's word. A file where a candidate does not parse as a statement
# (a ``raise`` quoted in a docstring, an unusual layout) is parsed whole, so nothing is lost.
_LOG_CALL = re.compile(r"(?:log|Log|LOG)\w*\.(?:debug|info|warning|warn|error|exception|critical|fatal)"
                       r"(?:_once)?\s*\(")
_RAISE = re.compile(r"raise\s+[\w.]+\s*\(")   # no leading \b nor ^: a literal prefix keeps the scan fast
_HELPER = re.compile(r"def\s+\w*(?:log|Log|LOG)\w*\s*\(")
_INDENT = re.compile(r"([ \t]*)(?:async\s+)?$")
# a keyword's words: a format split over adjacent literals ("kv " "cache") still shows one of them
WORDS = ("backend", "attention", "mla", "sparse", "top", "engine", "graph", "eager", "chunked", "prefill", "cache",
         "server", "dead", "valid")
WINDOW = 2000       # characters after a candidate that its format string starts within
MAX_LINES = 60      # a statement longer than this is parsed with its whole file


class _Whole(Exception):
    """A candidate did not parse alone: read the whole file."""


def _near(text, pos):
    window = text[pos:pos + WINDOW].lower()
    return any(w in window for w in WORDS)


def _lines_from(text, pos):
    """(start, end) of each line from the line holding ``pos`` on (end includes the newline)."""
    start = text.rfind("\n", 0, pos) + 1
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end == -1 else end + 1
        yield start, end
        start = end


def _statement(text, start):
    """The statement that begins at ``start`` as a parsed module: the text from ``start`` to the end of
    the first line where the brackets balance and it parses."""
    depth = 0
    for i, (ls, le) in enumerate(_lines_from(text, start)):
        if i >= MAX_LINES:
            break
        seg = text[max(ls, start):le]
        depth += seg.count("(") + seg.count("[") + seg.count("{") - seg.count(")") - seg.count("]") - seg.count("}")
        if depth > 0:
            continue
        try:
            return ast.parse(text[start:le])
        except (SyntaxError, ValueError):
            continue
    raise _Whole()


def _block(text, indent, pos):
    """A ``def`` block (its signature, then every deeper-indented or blank line after it), dedented; None
    when it returns nothing with a keyword's word (most ``*log*`` names are ``logits``/``logical``)."""
    lines, depth, body = [], 0, False
    for ls, le in _lines_from(text, pos):
        line = text[ls:le]
        if body and line.strip() and not line.startswith(indent + " ") and not line.startswith(indent + "\t"):
            break
        if not body:
            depth += line.count("(") + line.count("[") - line.count(")") - line.count("]")
            body = depth <= 0
        lines.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
    src = "".join(lines)
    if not any(_near(src, m.end()) for m in re.finditer(r"\breturn\b", src)):
        return None
    try:
        return ast.parse(src)
    except (SyntaxError, ValueError):
        raise _Whole() from None


def _fast(text, rel):
    out = []

    def add(node, offset, level, fmt, exc=None):
        if fmt is None or not _wanted(fmt):
            return
        rec = {"file": rel, "line": node.lineno + offset, "level": level, "format": fmt}
        if exc is not None:
            rec["exc"] = exc
        out.append(rec)

    def visit(tree, offset):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _is_logger(node.func) and node.args:
                level = node.func.attr[:-5] if node.func.attr.endswith("_once") else node.func.attr
                add(node, offset, level, _template(node.args[0]))
            elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                add(node, offset, "raise", _template(node.exc.args[0]), exc=_exc_name(node.exc))

    for rx in (_LOG_CALL, _RAISE):
        for m in rx.finditer(text):
            if not _near(text, m.end()):
                continue
            start = m.start()
            line_start = text.rfind("\n", 0, start) + 1
            if rx is _RAISE and start and (text[start - 1].isalnum() or text[start - 1] == "_"):
                continue  # "noraise(" and the like
            if rx is _LOG_CALL:
                while start > line_start and (text[start - 1].isalnum() or text[start - 1] in "_."):
                    start -= 1
            if "#" in text[line_start:start]:
                continue  # a comment
            visit(_statement(text, start), text.count("\n", 0, start))
    for m in _HELPER.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        ind = _INDENT.match(text, line_start, m.start())
        if ind is None:
            continue  # not a def statement
        tree = _block(text, ind.group(1), line_start)
        if tree is None:
            continue
        fn = tree.body[0] if tree.body else None
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise _Whole()
        offset = text.count("\n", 0, line_start)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "log" in node.name.lower():
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Return) and sub.value is not None:
                        add(sub, offset, "return", _template(sub.value))
    return _unique(out)


def harvest_text(text, rel):
    """``harvest_source``'s records, parsing only the candidate statements (the whole file when one of
    them does not parse alone)."""
    try:
        return _fast(text, rel)
    except _Whole:
        return harvest_source(text, rel)


def module_wanted(rel):
    """A module (path relative to ``vllm/``) the harvest reads: one of ``MODULES`` (str.startswith with the
    tuple: the integrity pass asks this for each of ~3,000 files)."""
    return rel.endswith(".py") and rel.startswith(MODULES)


# The controller's log-format cache (remote/formats_cache.py) sends the 16-hex-digit prefixes of the sha256
# digests whose formats it holds; the merge checks the full digest.
PREFIX = 16


def _decoded(data):
    """The text ``open(path, encoding="utf-8")`` reads: strict UTF-8, universal newlines."""
    text = data.decode("utf-8")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _modules(vllm_dir):
    """Every module the harvest reads, relative to ``vllm/`` (sliced, not os.path.relpath: ~3,000 files)."""
    cut = len(vllm_dir.rstrip("/")) + 1
    for root, dirs, files in os.walk(vllm_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            rel = (root + "/" + name)[cut:]
            if module_wanted(rel):
                yield rel


def harvest_tree(vllm_dir, whole=False, known=None, digests=None, cached=None, hashed=None):
    """Every kept format of an installed ``vllm/`` directory, over the modules in ``MODULES``
    (``whole``: parse every module whole, the reference the fast path is tested against).

    The controller's cache: ``digests`` ({rel: sha256 hex or None}) is the integrity pass's list of the
    modules with the digests it computed anyway (no walk here then; a module without one is hashed here when
    needed); a module whose digest has its prefix in ``known`` is not harvested, ``cached`` receives its
    {rel: full digest} and the controller fills in its formats. ``hashed`` (a dict) receives {rel: digest of
    the very bytes harvested} of every other module, for the controller to keep."""
    found = []
    read = harvest_source if whole else harvest_text
    cached = {} if cached is None else cached
    budget = ScanBudget()  # the install is the service user's: no symlink followed, no huge or sparse file
    for rel in (digests if digests is not None else _modules(vllm_dir)):
        path = vllm_dir + "/" + rel
        data = None
        sha = digests.get(rel) if digests is not None else None
        try:
            if known and sha is None:
                data = read_static(path, budget, base=vllm_dir)
                sha = hashlib.sha256(data).hexdigest()
            if known and sha[:PREFIX] in known:
                cached[rel] = sha
                continue
            if data is None:
                data = read_static(path, budget, base=vllm_dir)
            text = _decoded(data)
        except (OSError, UnicodeDecodeError):
            continue
        if hashed is not None:
            # the digest of what is harvested, not the integrity pass's: the file may have changed between
            hashed[rel] = hashlib.sha256(data).hexdigest()
        found.extend(read(text, rel))
    found.sort(key=lambda r: (r["file"], r["line"]))
    return found


def compact(recs):
    """Records as the agent sends them, like the shipped data: each format and file once, a site as
    ``[format, file, line, level[:exc]]`` (indexes), in the records' order."""
    formats = sorted({r["format"] for r in recs})
    files = sorted({r["file"] for r in recs})
    fidx = dict((f, i) for i, f in enumerate(formats))
    pidx = dict((f, i) for i, f in enumerate(files))
    sites = [[fidx[r["format"]], pidx[r["file"]], r["line"], r["level"] + (":" + r["exc"] if r.get("exc") else "")]
             for r in recs]
    return {"formats": formats, "files": files, "sites": sites}


def expand(doc):
    """``compact``'s records back (ValueError when malformed)."""
    out = []
    try:
        for fi, pi, line, level in doc["sites"]:
            rec = {"file": doc["files"][pi], "line": int(line), "level": str(level).split(":", 1)[0],
                   "format": doc["formats"][fi]}
            if ":" in str(level):
                rec["exc"] = str(level).split(":", 1)[1]
            out.append(rec)
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError("malformed formats: %s" % e) from None
    return out


def order(recs):
    """The order ``harvest_tree`` gives (by file and line; within a line as ``_unique`` sorts them)."""
    return sorted(recs, key=lambda r: (r["file"], r["line"], r["level"], r["format"]))
