"""The wheel's contents, decided without building it: setup.py finds every package on disk and adds the two
data packages that pyproject.toml maps from the top of the tree; those directories must exist and hold data."""
from __future__ import annotations

import ast
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.9/3.10
    tomllib = None

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_data_packages_are_mapped_and_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    st = cfg["tool"]["setuptools"]
    setup_py = (ROOT / "setup.py").read_text()
    listed = {n.value for n in ast.walk(ast.parse(setup_py)) if isinstance(n, ast.Constant)
              and isinstance(n.value, str)}
    assert st["package-dir"] == {"mla_doctor.playbooks": "playbooks", "mla_doctor.templates": "templates"}
    for pkg, d in st["package-dir"].items():
        assert pkg in listed, f"{pkg} is not added in setup.py"
        patterns = st["package-data"][pkg]
        assert any(f for pat in patterns for f in (ROOT / d).glob(pat)), f"{d}/ has nothing matching {patterns}"
    assert "packages" not in st  # setup.py's find_packages decides: new sub-packages ship without an edit
    assert not any(dep.startswith("fabric") for dep in cfg["project"]["dependencies"])
    assert any(dep.startswith("fabric") for dep in cfg["project"]["optional-dependencies"]["bench"])
