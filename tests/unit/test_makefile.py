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


def test_make_test_runs_the_guard_tier_right_after_lint():
    """`make guard` (tests/guard: no import cycle, the oldest Pythons, the speed ratios) runs in `make test` as
    soon as lint has passed, and the check for test directories left out of TIERS does not flag it."""
    rules = _rules()
    text = MAKEFILE.read_text()
    prereqs = rules["test"][0]
    assert "guard" in prereqs and prereqs.index("guard") == prereqs.index("lint") + 1, prereqs
    assert any(r == "$(PYTEST) -q tests/guard" for r in rules["guard"][1]), rules["guard"]
    assert "unit-data" in _needs(rules, "guard") and "system-packages" not in _needs(rules, "guard")
    phony = re.search(r"^\.PHONY:(.*)$", text.replace("\\\n", " "), re.M).group(1).split()
    assert "guard" in phony and "lint" in phony
    rest = next(r for r in rules["test"][1] if "test dirs not in TIERS" in r)
    assert re.search(r"grep -vxE '[^']*\|guard\|", rest), rest


def test_lint_holds_the_agent_to_3_8_and_the_controller_to_3_9():
    lint = _rules()["lint"][1]
    assert "$(VENV)/bin/vermin --no-tips --violations -t=3.8- mla_doctor/agent" in lint, lint
    assert "$(VENV)/bin/vermin --no-tips --violations -t=3.9- mla_doctor" in lint, lint


def test_make_demo_asks_only_for_its_own_system_packages():
    """Issue 32: `make demo` installs sshd and gdb, never the tiers' docker.io, chromium or nftables, and says
    each stage before it runs (no silent first minute)."""
    rules = _rules()
    demo = " ".join(rules["demo"][1])
    assert "system-packages" not in _needs(rules, "demo") and "system-packages" not in demo
    assert "demo-packages" in demo and demo.index("[demo] 1/3") < demo.index("demo-packages")
    assert "setup" not in demo.split() and "$(PY)" not in demo  # no dev venv (test extras) for the demo
    own = " ".join(rules["demo-packages"][1])
    assert "openssh-server" in own and "gdb" in own
    assert not any(p in own for p in ("docker.io", "chromium", "nftables", "systemd"))
    assert "demo-packages" in _needs(rules, "system-packages")  # the tiers get the demo's too


def test_make_test_fetches_the_corpus_behind_the_tiers_before_it():
    """The release wheels download in the background from the start of `make test`, and the corpus tier waits for
    that fetch (a cold machine spent ~15 min there, in series with everything else)."""
    rules = _rules()
    recipe = " ".join(rules["test"][1])
    start = recipe.index("tests/support/corpus.py --jobs")
    assert "& pre=$$!" in recipe[start:start + 120]
    tiers = re.search(r"^TIERS \?= (.*)$", MAKEFILE.read_text(), re.M).group(1).split()
    assert tiers.index("corpus") > tiers.index("unit") and tiers[-1] == "soak"
    assert 'if [ $$t = corpus ]; then wait $$pre' in recipe
    assert recipe.index("wait $$pre") < recipe.index("$(PYTEST) -q tests/$$t")
