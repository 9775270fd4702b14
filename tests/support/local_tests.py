"""Bring tests/unit/conftest.py's LOCAL (the unit tests that start processes) up to date.

Runs the fast loop (`pytest -m 'not local' tests/unit`) with MLA_DOCTOR_LOCAL_RECORD set, so the guard records
each unlisted test that starts a process instead of failing it, and collection records the listed names that
are no test; then rewrites LOCAL with the first added and the second dropped, and says what changed::

    .venv/bin/python tests/support/local_tests.py
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFTEST = ROOT / "tests" / "unit" / "conftest.py"
HEAD = "LOCAL: dict[str, object] = {\n"
WIDTH = 118


def _entry(stem: str, names) -> list[str]:
    if names == "*":
        return [f'    "{stem}": ALL,']
    toks = [f'"{n}"' for n in sorted(names)]
    lines, cur = [], f'    "{stem}": {{'
    for i, tok in enumerate(toks):
        tok += "," if i < len(toks) - 1 else "},"
        if cur.endswith("{") or len(cur) + 1 + len(tok) <= WIDTH:
            cur += ("" if cur.endswith("{") else " ") + tok
        else:
            lines.append(cur)
            cur = "        " + tok
    return lines + [cur]


def render(local: dict) -> str:
    return HEAD + "".join(line + "\n" for stem in sorted(local) for line in _entry(stem, local[stem])) + "}\n"


def current(text: str) -> tuple[dict, int, int]:
    """LOCAL as written in the conftest and where its block starts and ends."""
    start = text.index(HEAD)
    end = text.index("\n}\n", start) + 3
    body = text[start + len(HEAD):end - 2].replace("ALL", '"*"')
    return {k: (v if v == "*" else set(v)) for k, v in ast.literal_eval("{" + body + "}").items()}, start, end


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="mla-local-tests-") as tmp:
        out = Path(tmp) / "record.json"
        env = {**os.environ, "MLA_DOCTOR_LOCAL_RECORD": str(out)}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not local", "-p", "no:cacheprovider",
                        "tests/unit"], cwd=ROOT, env=env, check=False)
        found = json.loads(out.read_text())
    text = CONFTEST.read_text()
    local, start, end = current(text)
    for stem, names in found["stale"].items():
        local[stem] = set(local[stem]) - set(names)
        if not local[stem]:
            del local[stem]
        print(f"dropped from LOCAL[{stem!r}] (no such test): {', '.join(names)}")
    for stem, names in found["spawned"].items():
        if local.get(stem) != "*":
            local[stem] = set(local.get(stem, ())) | set(names)
        print(f"added to LOCAL[{stem!r}] (starts a process): {', '.join(names)}")
    CONFTEST.write_text(text[:start] + render(local) + text[end:])
    if not found["stale"] and not found["spawned"]:
        print("LOCAL is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
