"""The Makefile's contract for the dev loop: `make unit` (the fast loop) needs no system package and runs the
pure tests, `make test` runs every unit test and installs what the tiers need, `make clean` leaves no build."""
from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"


def _rules() -> dict[str, tuple[list[str], list[str]]]:
    """target -> (prerequisites, recipe lines), from the Makefile's text."""
    rules: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    for line in MAKEFILE.read_text().replace("\\\n", " ").splitlines():
        m = re.match(r"^([\w.$()/-]+):(?!=)\s*(.*)$", line)
        if m and not line.startswith("\t"):
            current = m.group(1)
            rules[current] = (m.group(2).split(), [])
        elif line.startswith("\t") and current:
            rules[current][1].append(line.strip())
        elif not line.strip() or line.startswith("#"):
            continue
        else:
            current = None
    return rules


def _needs(rules, target: str) -> set[str]:
    seen, todo = set(), [target]
    while todo:
        t = todo.pop()
        for p in rules.get(t, ([], []))[0]:
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def test_the_fast_loop_needs_no_system_package():
    rules = _rules()
    assert "system-packages" not in _needs(rules, "unit") | _needs(rules, "setup")
    assert {"system-packages"} <= _needs(rules, "test") & _needs(rules, "unit-local")
    assert any("-m 'not local' tests/unit" in r for r in rules["unit"][1])
    assert any("-m local tests/unit" in r for r in rules["unit-local"][1])


def test_make_test_runs_every_unit_test_and_clean_removes_the_build():
    rules = _rules()
    assert any("$(PYTEST) -q tests/$$t" in r for r in rules["test"][1])  # the whole tier: pure and local
    clean = " ".join(rules["clean"][1]).split()
    assert {"build", "*.egg-info", "$(VENV)"} <= set(clean)
