"""Run the scale-out examples (examples/scale-out/) as their engines would: the shard command per index, then
the merge — the real command lines from the files, with the engine's variables set and `mla-doctor` on PATH.

Each example marks its two command lines with a comment `# mla-doctor: shard` / `# mla-doctor: merge` on the
line before. Only the engine's own placeholders are substituted (a GitHub matrix expression); everything else
is run by bash as written, with the environment the engine would give it."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "scale-out"


@dataclass(frozen=True)
class Engine:
    file: str
    # shard index (1-based) and count -> the variables the engine sets for that task
    env: object
    # textual placeholders the engine expands before the shell sees the line
    expand: object = None


ENGINES = {
    "github-actions": Engine("github-actions.yml", lambda i, n: {"SHARDS": str(n)},
                             lambda line, i, n: line.replace("${{ matrix.shard }}", str(i))),
    "kubernetes": Engine("kubernetes-indexed-job.yaml",
                         lambda i, n: {"JOB_COMPLETION_INDEX": str(i - 1), "SHARDS": str(n)}),
    "slurm": Engine("slurm-array.sh", lambda i, n: {"SLURM_ARRAY_TASK_ID": str(i), "SLURM_ARRAY_TASK_COUNT": str(n)}),
}


def command(engine: str, which: str) -> str:
    """The example's command line marked `# mla-doctor: <which>` (the next line that runs mla-doctor)."""
    lines = (EXAMPLES / ENGINES[engine].file).read_text().splitlines()
    for k, line in enumerate(lines):
        if re.search(rf"#\s*mla-doctor:\s*{which}\b", line):
            for nxt in lines[k + 1:]:
                if "mla-doctor " in nxt:
                    cmd = re.sub(r"^\s*(#\s*)?(-\s*run:\s*)?", "", nxt).strip()
                    return cmd
    raise AssertionError(f"{engine}: no line marked '# mla-doctor: {which}'")


def shim_dir(tmp: Path) -> Path:
    """A PATH entry whose `mla-doctor` is this checkout's, run by this interpreter."""
    d = tmp / "bin"
    d.mkdir(exist_ok=True)
    exe = d / "mla-doctor"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))}${{PYTHONPATH:+:$PYTHONPATH}} "
                   f"exec {shlex.quote(sys.executable)} -m mla_doctor \"$@\"\n")
    exe.chmod(0o755)
    return d


def _line(engine: str, which: str, i: int, n: int, extra: list[str]) -> str:
    cmd = command(engine, which)
    if ENGINES[engine].expand:
        cmd = ENGINES[engine].expand(cmd, i, n)
    if extra:
        verb = "mla-doctor audit" if which == "shard" else "mla-doctor report merge"
        cmd = cmd.replace(verb, verb + " " + " ".join(shlex.quote(a) for a in extra), 1)
    return cmd


def start_shards(engine: str, n: int, tmp: Path, env: dict[str, str], extra: list[str]) -> list[subprocess.Popen]:
    """Every shard's task at once, in parallel processes, as the engine would start them."""
    base = {**os.environ, **env, "PATH": f"{shim_dir(tmp)}:{os.environ['PATH']}"}
    procs = []
    for i in range(1, n + 1):
        line = _line(engine, "shard", i, n, extra)
        procs.append(subprocess.Popen(["bash", "-c", line], env={**base, **ENGINES[engine].env(i, n)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      stdin=subprocess.DEVNULL, cwd=tmp))
    return procs


def run_merge(engine: str, tmp: Path, env: dict[str, str], extra: list[str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess:
    base = {**os.environ, **env, "PATH": f"{shim_dir(tmp)}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", _line(engine, "merge", 0, 0, extra or [])], env=base, text=True,
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=tmp)
