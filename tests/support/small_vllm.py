"""A real vLLM 0.33.0 install cut down to what an MLA audit reads (the attention, MLA, model, config and platform
sources, every package's __init__), with the wheel's RECORD cut to the same files, so its integrity is clean:
the real release's bytes, a tenth of its files. For tiers that audit many hosts or one host many times (the
fault tier's 50-host fleet, the soak), where the full tree's 3,000 files per audit would be the whole budget."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from tests.support import corpus

KEEP = re.compile(r"(attention|mla|deepseek|version|envs\.py|platforms/|^vllm/config/|^vllm/__init__\.py$)")


def build(dest: Path, version: str = "0.33.0") -> Path:
    """The cut-down tree (vllm/ and its dist-info) under dest, made once; returns dest."""
    if (dest / ".complete").exists():
        return dest
    src = corpus.ensure("vllm", version)
    dest.mkdir(parents=True, exist_ok=True)
    kept = set()
    for p in (src / "vllm").rglob("*.py"):
        rel = p.relative_to(src).as_posix()
        if KEEP.search(rel):
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, out)
            kept.add(rel)
    info = next(src.glob("vllm-*.dist-info"))
    shutil.copytree(info, dest / info.name, dirs_exist_ok=True)
    lines = (info / "RECORD").read_text().splitlines()
    record = [ln for ln in lines if ln.split(",", 1)[0] in kept or ln.startswith(info.name + "/")]
    (dest / info.name / "RECORD").write_text("\n".join(record) + "\n")
    (dest / ".complete").write_text("")
    return dest
