"""The static audit reads another user's tree: never through a symlink (reported instead), never a file too
large or sparse (a 1.5 GB hole named *.py), and a .pth only as the import lines it holds (one linked to
/proc/self/environ or to a root-only file never lands in the report)."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

from mla_doctor.agent.facts import integrity, install


def _tree(tmp_path):
    site = tmp_path / "site-packages"
    v = site / "vllm"
    v.mkdir(parents=True)
    (v / "__init__.py").write_text("")
    (v / "ok.py").write_text("def forward_mha(self):\n    pass\n")
    return site, v


def test_a_symlinked_source_file_is_reported_never_followed(tmp_path):
    site, v = _tree(tmp_path)
    secret = tmp_path / "secret.py"
    secret.write_text("def forward_mha(): 'root secret'\n")
    secret.chmod(0o600)
    (v / "link.py").symlink_to(secret)
    out = integrity.scan_tree(str(v), None, ["forward_mha"])
    assert {"path": "vllm/link.py", "error": "a symlink: not followed"} in out["unreadable"]
    assert out["symbol_hits"] == {"forward_mha": [["ok.py", 1]]}
    assert "secret" not in json.dumps(out)


def test_a_huge_sparse_source_file_is_refused_without_reading_it(tmp_path):
    site, v = _tree(tmp_path)
    with open(v / "huge.py", "wb") as f:
        f.truncate(1536 << 20)  # 1.5 GB of nothing: a hole, no blocks
    with open(v / "holes.py", "wb") as f:
        f.truncate(8 << 20)  # under the size cap, but a hole all the same: sized against its blocks
    # the child's own peak (VmHWM: this process's memory only): ru_maxrss would carry the peak of the pytest
    # process it was forked from (Linux keeps it across exec), which a long unit tier grows past the bound
    code = ("import json, sys; from mla_doctor.agent.facts import integrity; "
            "out = integrity.scan_tree(sys.argv[1], None, ['forward_mha']); "
            "hwm = [ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0]; "
            "print(json.dumps([out['unreadable'], int(hwm)]))")
    p = subprocess.run([sys.executable, "-c", code, str(v)], capture_output=True, text=True, timeout=120)
    unreadable, maxrss_kb = json.loads(p.stdout)
    why = {u["path"]: u["error"] for u in unreadable}
    assert sorted(why) == ["vllm/holes.py", "vllm/huge.py"] and "not read" in why["vllm/huge.py"]
    assert why["vllm/holes.py"].startswith("sparse")
    assert maxrss_kb < 200 * 1024, "the scan allocated %d KB" % maxrss_kb
    assert resource.getpagesize() > 0


def test_pth_files_are_reported_as_their_import_lines_only(tmp_path):
    site, _v = _tree(tmp_path)
    (site / "a_env.pth").symlink_to("/proc/self/environ")
    secret = tmp_path / "root-only"
    secret.write_text("import os  # root's secret\n")
    secret.chmod(0o600)
    (site / "b_private.pth").symlink_to(secret)
    (site / "c_real.pth").write_text("/some/dir\nimport _virtualenv\n#comment\nVLLM_KEY=abc\0HOME=/root\n")
    os.mkfifo(site / "d_fifo.pth")
    pth = {p["file"]: p for p in integrity.side_code(str(site))["pth_files"]}
    assert pth["a_env.pth"] == {"file": "a_env.pth", "imports": [], "paths": 0, "error": "a symlink: not followed"}
    assert pth["b_private.pth"]["imports"] == [] and "error" in pth["b_private.pth"]
    assert pth["c_real.pth"]["imports"] == ["import _virtualenv"] and pth["c_real.pth"]["paths"] == 1
    assert "error" in pth["d_fifo.pth"]
    text = json.dumps(pth)
    assert "VLLM_KEY" not in text and "root's secret" not in text and "/some/dir" not in text


def test_dist_info_files_are_never_read_through_a_symlink(tmp_path):
    site, v = _tree(tmp_path)
    di = site / "vllm-0.33.0.dist-info"
    di.mkdir()
    secret = tmp_path / "meta"
    secret.write_text("Name: vllm\nVersion: 6.6.6-from-a-root-only-file\n")
    (di / "METADATA").symlink_to(secret)
    (di / "RECORD").write_text("vllm/__init__.py,,\n")
    ident = install.vllm_identity(str(v))
    assert ident["version"] != "6.6.6-from-a-root-only-file"


def test_one_walk_opens_each_directory_once_with_the_same_answers(tmp_path, monkeypatch):
    """common.Beneath (the scan's opener) answers what open_beneath answers file by file -- the bytes, or the
    same error for a link (final or a directory on the way), a missing file, a path outside -- while it opens each
    directory once for the files below it and keeps at most the walk's depth open."""
    import errno

    from mla_doctor.agent import common

    site, v = _tree(tmp_path)
    for d in ("a", "a/b", "a/b/c", "d"):
        (v / d).mkdir()
        for i in range(3):
            (v / d / f"m{i}.py").write_text(f"# {d} {i}\n")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "s.py").write_text("secret\n")
    (v / "a" / "linked").symlink_to(secret)
    (v / "a" / "b" / "l.py").symlink_to(secret / "s.py")
    paths = [str(v / p) for p in ("__init__.py", "ok.py", "a/m0.py", "a/b/m0.py", "a/b/c/m0.py", "a/b/c/m2.py",
                                  "a/b/l.py", "a/linked/s.py", "a/linked/s.py", "a/b/m1.py", "a/nope.py", "d/m1.py",
                                  "a/../ok.py")] + [str(secret / "s.py")]

    def answer(opener, p):
        try:
            return common.read_open(opener(p, common.READ_FLAGS), p)
        except OSError as e:
            return errno.errorcode[e.errno]

    want = []
    for p in paths:
        want.append(answer(lambda q, f: common.open_beneath(str(v), q, f), p))
    assert want[:6] == [b"", b"def forward_mha(self):\n    pass\n", b"# a 0\n", b"# a/b 0\n", b"# a/b/c 0\n",
                        b"# a/b/c 2\n"]
    assert want[6:] == ["ELOOP", "ELOOP", "ELOOP", b"# a/b 1\n", "ENOENT", b"# d 1\n", "EINVAL", "EINVAL"]

    opens, real_open = [], os.open
    monkeypatch.setattr(os, "open", lambda *a, **kw: opens.append(a[0]) or real_open(*a, **kw))
    before = len(os.listdir("/proc/self/fd"))
    walk = common.Beneath(str(v))
    got, most = [], 0
    for p in paths:
        got.append(answer(walk.open, p))
        most = max(most, len(os.listdir("/proc/self/fd")) - before)
    walk.close()
    assert got == want
    assert len(os.listdir("/proc/self/fd")) == before  # closed
    assert most <= 5  # top, a, b, c (and listdir's own)
    dir_opens = [n for n in opens if not str(n).endswith(".py")]
    # per file, open_beneath would open 27 directories here; a link on the way is tried again (and refused again)
    assert dir_opens == [str(v), "a", "b", "c", "linked", "linked", "b", "d"], dir_opens
