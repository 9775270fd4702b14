"""Harvest how each release's platform code names the attention backend it selects: the display text of its
``Using <text> backend`` log line -> the backend's enum name (``AttentionBackendEnum.X`` / ``_Backend.X`` the
code returns next, or the ``get_name()`` of the class path it returns). Writes
``mla_doctor/diagnosis/knowledge/backend_display_names.json``. Usage: python tools/gen_backend_names.py [SRC_DIR]
(default ~/.cache/mla-doctor/vllm-src, the corpus)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "mla_doctor/diagnosis/knowledge/backend_display_names.json"
_LOG = re.compile(r'logger\.\w+\(\s*"Using ([A-Za-z][\w /.-]*?) (?:attention )?backend(?: on V1 engine| on XPU)?\.?"')
_ENUM = re.compile(r"\b(?:AttentionBackendEnum|_Backend)\.(\w+)")
_PATH = re.compile(r'"(vllm\.[\w.]+\.(\w+))"')
_GETNAME = re.compile(r'def get_name\(\)[^:]*:\s*\n\s*return\s+"(\w+)"')


def _get_name(root: Path, dotted: str) -> str | None:
    mod, _cls = dotted.rsplit(".", 1)
    f = root / (mod.replace(".", "/") + ".py")
    try:
        text = f.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    i = text.find("class %s(" % _cls)
    m = _GETNAME.search(text, i) if i >= 0 else None
    return m.group(1) if m else None


def harvest(src: Path) -> dict:
    out: dict = {}
    for rel in sorted(p for p in src.iterdir() if (p / "vllm/platforms").is_dir()):
        for f in sorted((rel / "vllm/platforms").glob("*.py")):
            lines = f.read_text(encoding="utf-8", errors="replace").splitlines()
            for i, line in enumerate(lines):
                m = _LOG.search(line)
                if not m or m.group(1).isupper() and "_" in m.group(1):
                    continue
                name = None
                for nxt in lines[i + 1:i + 8]:
                    e = _ENUM.search(nxt)
                    if e:
                        name = e.group(1)
                        break
                    p = _PATH.search(nxt)
                    if p:
                        name = _get_name(rel, p.group(1))
                        break
                    if nxt.strip().startswith(("if ", "elif ", "else", "def ")):
                        break
                if not name:
                    continue
                name = re.sub(r"_VLLM_V1$", "", name)
                ent = out.setdefault(m.group(1), {})
                ent.setdefault(name, []).append("%s:vllm/platforms/%s:%d" % (rel.name, f.name, i + 1))
    return out


_REG = re.compile(r'^ {4}([A-Z][A-Z0-9_]+) = \(?\s*"(vllm\.[\w.]+)\.(\w+)"', re.M)


def harvest_registry(src: Path) -> tuple:
    """(class name -> enum, module basename -> enum) from each release's AttentionBackendEnum registry."""
    classes: dict = {}
    modules: dict = {}
    for rel in sorted(p for p in src.iterdir() if (p / "vllm").is_dir()):
        for reg in ("vllm/attention/backends/registry.py", "vllm/v1/attention/backends/registry.py"):
            f = rel / reg
            if not f.is_file():
                continue
            for name, mod, cls in _REG.findall(f.read_text(encoding="utf-8", errors="replace")):
                classes.setdefault(cls, {}).setdefault(name, rel.name)
                modules.setdefault(mod.rsplit(".", 1)[-1], {}).setdefault(name, rel.name)
    one = lambda d: {k: sorted(v)[0] for k, v in sorted(d.items()) if len(v) == 1}  # noqa: E731 - ambiguous dropped
    return one(classes), one(modules)


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache/mla-doctor/vllm-src"
    data = harvest(src)
    doc = {"schema": 1, "generated_by": "tools/gen_backend_names.py",
           "names": {k: {n: {"sites": len(s), "first": s[0], "last": s[-1]} for n, s in sorted(v.items())}
                     for k, v in sorted(data.items())}}
    doc["classes"], doc["modules"] = harvest_registry(src)
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print("%d display names, %d classes, %d modules -> %s" % (len(data), len(doc["classes"]), len(doc["modules"]), OUT))


if __name__ == "__main__":
    main()
