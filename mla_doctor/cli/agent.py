"""`mla-doctor agent`: the host agent for debugging by hand (AnsiballZ's explode): the exact payload's
sources and a script that runs them on a host (--dump DIR), and the plan a `static` audit sends (--plan)."""
from __future__ import annotations

import json

import click

from mla_doctor.cli.common import cli, handle_errors
from mla_doctor.errors import UsageError
from mla_doctor.host.agent_dump import dump_agent, static_audit_plan
from mla_doctor.host.audit import AuditOptions


@cli.command()
@click.option("--dump", "dump_dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Write the payload's sources, bootstrap.py, run.py, README.txt and plan-static.json to DIR "
                   "(new, empty, or an earlier dump).")
@click.option("--plan", "print_plan", is_flag=True, help="Print the JSON plan of a `static` audit.")
@click.option("--python", "python", metavar="PATH", help="The plan's interpreter whose site-packages hold vLLM.")
@click.option("--model", "model", metavar="PATH", help="The plan's model directory or config.json.")
@click.option("--log", "log", metavar="PATH", help="The plan's server log file.")
@handle_errors("agent")
def agent(dump_dir, print_plan, python, model, log):
    """Debug the host agent by hand: write the exact payload mla-doctor sends and a script that runs it.

    \b
    mla-doctor agent --dump /tmp/mla-agent           # then read /tmp/mla-agent/README.txt
    scp -r /tmp/mla-agent gpu-17:/tmp/ && ssh gpu-17 python3 /tmp/mla-agent/run.py
    mla-doctor agent --plan --python /opt/vllm/bin/python > plan.json
    """
    if not dump_dir and not print_plan:
        raise UsageError("give --dump DIR (the payload as files) and/or --plan (a static audit's plan)")
    opts = AuditOptions(python=python, model=model, log=log)
    if dump_dir:
        d = dump_agent(dump_dir, opts)
        click.echo(f"wrote {len(d.sources)} agent sources (sha256 {d.sources_sha256[:16]}), run.py and "
                   f"{', '.join(d.plans)} to {d.directory}; see {d.directory / 'README.txt'}", err=True)
    if print_plan:
        click.echo(json.dumps(static_audit_plan(opts), indent=1, sort_keys=True))
