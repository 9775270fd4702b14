"""pyproject.toml lists the packages explicitly (the data directories are mapped into the package):
every package directory must be in that list, and the mapped data directories must exist."""
from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.9/3.10
    tomllib = None

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_every_package_is_in_the_wheel_and_data_maps_exist():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mla_doctor").rglob("__init__.py")}
    assert on_disk - listed == set(), "packages missing from pyproject.toml [tool.setuptools] packages"
    for pkg, d in cfg["package-dir"].items():
        assert pkg in listed and (ROOT / d).is_dir()
        assert any((ROOT / d).iterdir())
        assert cfg["package-data"][pkg]
    assert "fabric" not in " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
