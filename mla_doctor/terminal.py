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
