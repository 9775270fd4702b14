"""tools/codemod_public_names.py on a small tree of its own: what crosses agent modules becomes public, everywhere
it is named; once applied nothing is left to do; a reference merged in later under the old name is rewritten too;
a new name that would collide is refused with nothing written."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "codemod_public_names.py"


@pytest.fixture()
def codemod():
    spec = importlib.util.spec_from_file_location("codemod_public_names", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


BASE = {
    "mla_doctor/__init__.py": "",
    "mla_doctor/agent/__init__.py": "",
    "mla_doctor/agent/common.py": 'def _stamp():\n    """See _helper."""\n    return _helper()\n\n\n'
                                  "def _helper():  # only here: stays private\n    return 1\n",
    "mla_doctor/agent/fs.py": "from .common import _stamp\n\n\ndef write(x):\n    return _stamp(), x.y._stamp\n",
    "mla_doctor/agent/facts/__init__.py": "",
    "mla_doctor/agent/facts/ops.py": "from .. import common\n\n\ndef f():\n    return common._stamp()  # _stamp\n",
    "tests/test_x.py": "from mla_doctor.agent import fs\n\n\ndef test(monkeypatch):\n"
                       "    monkeypatch.setattr(fs, '_stamp', lambda: 2)\n"
                       "    monkeypatch.setattr(\"mla_doctor.agent.common._stamp\", None)\n",
}


def test_renames_what_crosses_modules_everywhere_and_only_that(codemod, tmp_path):
    _tree(tmp_path, BASE)
    assert codemod.main(["--root", str(tmp_path), "--check"]) == 1
    assert not (tmp_path / "mla_doctor/agent/common.py").read_text().startswith("def stamp")  # --check wrote nothing
    assert codemod.main(["--root", str(tmp_path)]) == 0
    read = lambda rel: (tmp_path / rel).read_text()  # noqa: E731
    assert read("mla_doctor/agent/common.py") == BASE["mla_doctor/agent/common.py"].replace("_stamp", "stamp")
    assert "def _helper" in read("mla_doctor/agent/common.py")
    assert read("mla_doctor/agent/fs.py") == \
        "from .common import stamp\n\n\ndef write(x):\n    return stamp(), x.y._stamp\n"  # x.y's own: kept
    assert "common.stamp()  # stamp" in read("mla_doctor/agent/facts/ops.py")
    test = read("tests/test_x.py")
    assert "setattr(fs, 'stamp'" in test and '"mla_doctor.agent.common.stamp"' in test
    assert codemod.main(["--root", str(tmp_path), "--check"]) == 0  # idempotent: nothing left


def test_a_merge_written_against_the_old_name_is_rewritten(codemod, tmp_path):
    _tree(tmp_path, BASE)
    assert codemod.main(["--root", str(tmp_path)]) == 0
    _tree(tmp_path, {"mla_doctor/agent/late.py": "from .fs import _stamp\nfrom . import common\nX = common._stamp\n"})
    assert codemod.main(["--root", str(tmp_path)]) == 0
    assert (tmp_path / "mla_doctor/agent/late.py").read_text() == \
        "from .fs import stamp\nfrom . import common\nX = common.stamp\n"


def test_a_collision_is_refused_and_nothing_written(codemod, tmp_path, capsys):
    files = dict(BASE)
    files["mla_doctor/agent/fs.py"] = "from .common import _stamp\n\n\ndef write(stamp):\n    return _stamp(), stamp\n"
    _tree(tmp_path, files)
    assert codemod.main(["--root", str(tmp_path)]) == 2
    assert "mla_doctor/agent/fs.py: already uses stamp" in capsys.readouterr().err
    assert (tmp_path / "mla_doctor/agent/common.py").read_text() == BASE["mla_doctor/agent/common.py"]


def test_imports_of_moved_modules_and_names_point_at_their_new_places(codemod, tmp_path, capsys):
    files = dict(BASE)
    files.update({
        "mla_doctor/agent/daemon.py": "def _watchdog_pid(d):\n    return 1\n",
        "mla_doctor/agent/runtimes/__init__.py": "",
        "mla_doctor/agent/runtimes/registry.py": "def restore_server(d):\n    return d\n",
        "mla_doctor/agent/runtimes/docker.py": "from .registry import restore_server\n",
        "mla_doctor/agent/attach/__init__.py": "",
        "mla_doctor/agent/attach/watch.py": "def stop(d):\n    from ..change.daemon import _watchdog_pid\n"
                                            "    from ..runtimes.lifecycle import restore_server\n"
                                            "    return _watchdog_pid(d), restore_server(d)\n",
        "tests/test_y.py": "from mla_doctor.agent.change.daemon import _watchdog_pid\n",
    })
    _tree(tmp_path, files)
    assert codemod.main(["--root", str(tmp_path)]) == 0
    assert (tmp_path / "mla_doctor/agent/attach/watch.py").read_text() == (
        "def stop(d):\n    from ..daemon import watchdog_pid\n    from ..runtimes.registry import restore_server\n"
        "    return watchdog_pid(d), restore_server(d)\n")
    assert (tmp_path / "tests/test_y.py").read_text() == "from mla_doctor.agent.daemon import watchdog_pid\n"
    assert codemod.main(["--root", str(tmp_path), "--check"]) == 0
    _tree(tmp_path, {"mla_doctor/agent/attach/mixed.py": "from ..runtimes.lifecycle import restore_server, op_tick\n"})
    assert codemod.main(["--root", str(tmp_path)]) == 2
    assert "attach/mixed.py:1: imports names that moved to different modules" in capsys.readouterr().err
