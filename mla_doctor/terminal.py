"""Host-provided strings made inert before they reach a terminal, a Markdown page or an XML file.

A log line, vLLM's METADATA, a file name or an error message comes from a machine someone else controls:
an `ESC ] 52` (OSC 52) writes the operator's clipboard, `ESC [ 2J` clears the screen and hides what came
before, OSC 8 makes a link, a bare CR or a bidi override makes text read other than it is. Every writer
passes such strings through `line()` (one line: newlines shown too) or `text()` (newlines kept): C0 and C1
controls, DEL, ESC and the bidi/line-separator code points are shown escaped (`\\x1b`, `\\u202e`), so the
evidence stays readable and nothing is interpreted. `xml()` also drops what XML 1.0 cannot carry.
"""
from __future__ import annotations

from typing import Any


class Note(str):
    """A progress message that continues the step before it (a wait's seconds so far, the server's newest log
    line): redrawn where a terminal shows the current step, never a line of its own in a plain (piped) log."""


def _escape(cp: int) -> str:
    return f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}"


# bidi embeddings/overrides/isolates, the line/paragraph separators, the BOM-less zero-width no-break space
_UNICODE_CONTROLS = [*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C, 0x2028, 0x2029, 0xFEFF]
_CONTROLS = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), *_UNICODE_CONTROLS]
_LINE = str.maketrans({cp: _escape(cp) for cp in _CONTROLS})
_TEXT = str.maketrans({cp: _escape(cp) for cp in _CONTROLS if cp not in (0x09, 0x0A)})
_SURROGATES = range(0xD800, 0xE000)


def line(value: Any) -> str:
    """One line of inert text: every control, newline and tab included, shown escaped."""
    s = value if isinstance(value, str) else str(value)
    return s.translate(_LINE) if not s.isprintable() else s


def text(value: Any) -> str:
    """Inert text that may span lines: newlines and tabs kept, every other control shown escaped."""
    s = value if isinstance(value, str) else str(value)
    return s.translate(_TEXT) if not s.isprintable() else s


def xml(value: Any, keep_newlines: bool = True) -> str:
    """Text an XML 1.0 file can carry: controls escaped as in `text()`/`line()`, and what XML cannot hold at
    all (lone surrogates, U+FFFE, U+FFFF) shown escaped too, so the document stays valid and readable."""
    s = text(value) if keep_newlines else line(value)
    if any(0xD800 <= ord(c) < 0xE000 or c in "\ufffe\uffff" for c in s):
        s = "".join(_escape(ord(c)) if ord(c) in _SURROGATES or c in "\ufffe\uffff" else c for c in s)
    return s


def _pieces(word: str, width: int) -> list[str]:
    """A word longer than the width, broken where a reader expects it: after a `/` (a path), else after `.`, `_`,
    `-` or `,`; cut mid-name only where one name alone is wider than the line."""
    out: list[str] = []
    cur = ""
    for part in _split_after(word, "/"):
        if len(part) > width:  # one path component wider than the line: its own natural breaks, then a hard cut
            subs = [s for p in _split_after(part, "._-,") for s in (p[i:i + width] for i in range(0, len(p), width))]
        else:
            subs = [part]
        for sub in subs:
            if cur and len(cur) + len(sub) > width:
                out.append(cur)
                cur = ""
            cur += sub
    return out + ([cur] if cur else [])


def _split_after(word: str, seps: str) -> list[str]:
    parts, cur = [], ""
    for ch in word:
        cur += ch
        if ch in seps:
            parts.append(cur)
            cur = ""
    return parts + ([cur] if cur else [])


def wrap(value: Any, width: int) -> list[str]:
    """One line of inert text wrapped to `width` without losing a character: breaks at spaces, a long path after
    a `/`, never an ellipsis. `width` <= 0: not wrapped (piped output)."""
    s = line(value)
    if width <= 0 or len(s) <= width:
        return [s]
    out: list[str] = []
    cur = ""
    for word in s.split(" "):
        if len(word) > width:
            pieces = _pieces(word, width)
            if cur and len(cur) + 1 + len(pieces[0]) <= width:
                pieces[0] = cur + " " + pieces[0]
            elif cur:
                out.append(cur)
            out += pieces[:-1]
            cur = pieces[-1]
        elif not cur:
            cur = word
        elif len(cur) + 1 + len(word) <= width:
            cur += " " + word
        else:
            out.append(cur)
            cur = word
    out.append(cur)
    return out


def wrap_lines(value: Any, width: int) -> list[str]:
    """Text that may span lines (a gdb error, a traceback's tail), each of its lines wrapped as `wrap` does: only a
    newline becomes a line break (a multi-line error reads as lines, not `\\x0a`); every other control, a CR or a
    tab included, is still shown escaped. Trailing empty lines dropped."""
    s = value if isinstance(value, str) else str(value)
    parts = s.split("\n")
    while len(parts) > 1 and not parts[-1].strip():
        parts.pop()
    return [piece for part in parts for piece in wrap(part, width)]
