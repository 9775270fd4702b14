"""Every bench/ script still runs against the current API: `--help` exits 0, and every name it imports from
mla_doctor or tests (at the top or inside a function, where a benchmark imports late) exists."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))


def test_there_are_bench_scripts():
    assert {p.name for p in SCRIPTS} >= {"floor.py", "fleet_compare.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_runs(script):
    p = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "usage:" in p.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_imported_name_exists(script):
    missing = []
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("mla_doctor", "tests"):
            mod = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(mod, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{script.name}:{node.lineno}: {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("mla_doctor", "tests"):
                    importlib.import_module(alias.name)
    assert not missing
