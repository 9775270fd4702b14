"""Fleet commands on the main click group: `audit`, `playbooks`, `report merge|render`.

Thin: parse options, load inventory + playbook (usage errors name file:line before any
connection), hand the hosts to `fleet.run_fleet`, render reports, exit with the worst host's status.
"""
from __future__ import annotations

import json
import sys
import time

import click

from mla_doctor import __version__, reports, terminal
from mla_doctor.cli.common import (
    PORT,
    SECONDS,
    check_writable,
    cli,
    handle_errors,
    output_file_option,
    terminal_width,
    write_output,
)
from mla_doctor.cli.progress import Progress
from mla_doctor.errors import ConfigFileError, UsageError
from mla_doctor.exit_codes import ExitStatus
from mla_doctor.fleet import inventory as inv_mod
from mla_doctor.fleet import playbook as pb_mod
from mla_doctor.fleet.job import execute_host, fleet_undo
from mla_doctor.fleet.playbook import catalog
from mla_doctor.fleet.scheduler import Events, FleetHostReport, run_fleet
from mla_doctor.redact import redact_tree
from mla_doctor.results import HostStatus
from mla_doctor.safety import check_env_name
from mla_doctor.host.target import HOST_KEY_POLICIES, connect_options

_FMT = click.Choice(["text", "json", "junit", "markdown", "html"])
_OUT = click.Path(dir_okay=False)


# ------------------------------------------------------------------------------------- audit

def _extra_vars(items) -> dict:
    import yaml

    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.isidentifier():
            raise UsageError(f"-e {item!r}: expected KEY=VALUE")
        try:
            out[k] = yaml.safe_load(v) if v else ""
        except yaml.YAMLError:
            out[k] = v
    return out


def _write_extra(doc: dict, outputs: dict, texts: dict | None = None) -> None:
    """`texts`: the formats already rendered (a saved report's, rendered where its errors are the file's)."""
    for fmt, path in outputs.items():
        if path:
            reports.write(path, (texts or {}).get(fmt) or reports.render(doc, fmt))


@cli.command("audit")
@click.option("-i", "--inventory", "inventory_path", required=True, type=click.Path(dir_okay=False),
              help="Inventory: mla-doctor YAML, Ansible YAML or Ansible INI (see inventory.example.yaml).")
@click.option("--limit", "-l", "limit", metavar="PATTERN",
              help="Groups, host names or globs, @RETRY-FILE; ',' separated; !x excludes, &x intersects.")
@click.option("--playbook", "-p", "playbook_name", default="static", show_default=True, metavar="NAME|FILE",
              help="Runbook: bundled name (`mla-doctor playbooks`) or a YAML file.")
@click.option("--forks", "-f", type=click.IntRange(1, 256), default=10, show_default=True,
              help="Hosts worked on at once.")
@click.option("--serial", type=click.IntRange(1, 256), default=None,
              help="Playbooks that restart servers: at most this many servers down at once "
                   "(default: the playbook's, else 1).")
@click.option("--max-fail-percent", type=click.FloatRange(0, 100), default=None,
              help="Stop starting hosts once more than this % of all hosts failed "
                   "(default: playbook's; 0 for restarting playbooks, 100 otherwise).")
@click.option("--host-timeout", type=SECONDS, default=None, help="Seconds for one host's whole job "
              "(default 600 for read-only playbooks, 3600 when restarting; inventory var host_timeout wins).")
@click.option("--shard", metavar="I/N", help="Run only shard I of N of the selected hosts (deterministic).")
@click.option("-e", "--extra-var", "extra", multiple=True, metavar="KEY=VALUE", help="Template variable (YAML value).")
@click.option("--dry-run", is_flag=True, help="Print the plan per host; connect to nothing, change nothing.")
@click.option("--format", "fmt", type=_FMT, default="text", show_default=True)
@output_file_option("Write the --format report to FILE instead of stdout.")
@click.option("--json", "json_out", type=_OUT, callback=check_writable, help="Also write the JSON report to FILE.")
@click.option("--junit", "junit_out", type=_OUT, callback=check_writable, help="Also write JUnit XML to FILE.")
@click.option("--markdown", "md_out", type=_OUT, callback=check_writable, help="Also write Markdown to FILE.")
@click.option("--html", "html_out", type=_OUT, callback=check_writable, help="Also write the HTML page to FILE.")
@click.option("--retry-file", type=_OUT, callback=check_writable,
              help="Write the hosts that did not pass (fault, error, unreachable, not run) to FILE, one a line.")
@click.option("--progress", "progress_mode", type=click.Choice(["auto", "live", "plain", "none"]), default="auto",
              show_default=True, help="auto: live on a terminal, plain lines otherwise, none with --format json.")
@click.option("--user", help="Default SSH user (inventory vars win).")
@click.option("--port", type=PORT, help="Default SSH port, 1-65535 (inventory vars win).")
@click.option("--identity", multiple=True, type=click.Path(dir_okay=False), help="Default private key (repeatable).")
@click.option("--python", "python", metavar="PATH", help="Default interpreter whose site-packages hold vLLM.")
@click.option("--ssh-config", type=click.Path(dir_okay=False), default=None, help="ssh_config to read.")
@click.option("--known-hosts", type=click.Path(dir_okay=False), help="known_hosts file to verify against.")
@click.option("--host-key-policy", type=click.Choice(HOST_KEY_POLICIES), default=None)
@click.option("--connect-timeout", type=SECONDS, default=10.0, show_default=True, help="Seconds (> 0).")
@click.option("--command-timeout", type=SECONDS, default=120.0, show_default=True, help="Seconds (> 0).")
@click.option("--sudo", is_flag=True, help="Default: run the agent with `sudo -n`.")
@click.option("--yes", "-y", is_flag=True, help="Consent to restart servers (playbooks that restart; no terminal).")
@click.option("--api-key-env", "api_key_envs", multiple=True, metavar="NAME",
              help="Allow the inventory's or runbook's api_key_env NAME (repeatable); without it only "
                   "*_API_KEY and VLLM_* names are sent to a host.")
@handle_errors("audit")
def audit_cmd(inventory_path, limit, playbook_name, forks, serial, max_fail_percent, host_timeout, shard, extra,
              dry_run, fmt, output, json_out, junit_out, md_out, html_out, retry_file, progress_mode, yes,
              api_key_envs=(), **kw):
    """Audit a fleet from an inventory with a runbook: bounded parallelism, rolling restarts, reports.

    \b
    mla-doctor audit -i inventory.yaml
    mla-doctor audit -i hosts.ini --limit 'gpu,!canary' --junit audit.xml --html audit.html
    mla-doctor audit -i inventory.yaml --limit @failed.retry --retry-file failed.retry
    mla-doctor audit -i inventory.yaml --playbook mla-path --serial 2 --max-fail-percent 10 --yes
    mla-doctor audit -i inventory.yaml --shard 1/4 --format json -o shard1.json
    """

    for name in api_key_envs:  # names only (as `run --api-key-env`), before any file is read
        check_env_name(name, "--api-key-env")
    inv = inv_mod.load(inventory_path, allow_env=api_key_envs)
    pb = pb_mod.load(playbook_name)
    hosts = inv.select(limit)
    shard_txt = None
    if shard:
        i, n = inv_mod.parse_shard(shard)
        hosts = inv_mod.shard(hosts, i, n)
        shard_txt = f"{i}/{n}"
    extra_vars = _extra_vars(extra)
    for h in hosts:  # -e wins over the inventory, connection vars included (as in Ansible)
        inv_mod.apply_extra_vars(h, extra_vars, strict=inv.format == "mla-doctor")
    plans = {h.name: pb_mod.plan(pb, h, extra_vars) for h in hosts}  # template errors: before any connection
    for p in plans.values():  # a runbook's own api_key_env: the inventory's allow-list
        for st in p.steps:
            name = st.options.get("api_key_env") if isinstance(st.options, dict) else None
            if isinstance(name, str) and not inv_mod.api_key_env_allowed(name, api_key_envs):
                raise ConfigFileError(pb.path or pb.name, st.line,
                                      f"step {st.name}: api_key_env {name!r} is not an API key variable a runbook "
                                      f"may name ({' or '.join(inv_mod.API_KEY_ENV_ALLOWED)}); to allow it, give "
                                      f"--api-key-env {name} on the command line")
    restarts = pb.restarts
    limit_n = min(forks, serial or pb.serial or 1) if restarts else forks
    mfp = max_fail_percent if max_fail_percent is not None else (
        pb.max_fail_percent if pb.max_fail_percent is not None else (0.0 if restarts else None))
    default_timeout = host_timeout or (3600.0 if restarts else 600.0)
    meta = {"inventory": inventory_path, "inventory_format": inv.format, "playbook": pb.name,
            "playbook_path": pb.path, "limit": limit, "shard": shard_txt, "forks": forks,
            "serial": limit_n if restarts else None, "max_fail_percent": mfp, "restarts": restarts,
            "selected": len(hosts)}
    if dry_run:
        _print_plan(plans, pb, meta, fmt, output, kw)
        sys.exit(0)
    if restarts and not yes:
        if sys.stdin.isatty() and fmt != "json":
            if not click.confirm(f"playbook {pb.name} restarts the vLLM server on {len(hosts)} host(s), "
                                 f"{limit_n} at a time. Continue?"):
                raise UsageError("not confirmed")
        else:
            raise UsageError(f"playbook {pb.name} restarts servers: pass --yes (no terminal to confirm on)")
    defaults = connect_options(kw)  # the same builder as one host's; each host's inventory vars win (fleet/job)
    mode = progress_mode
    if mode == "auto":
        mode = "quiet" if fmt == "json" else ("live" if sys.stderr.isatty() else "plain")
    elif mode == "none":
        mode = "quiet"
    prog = Progress(len(hosts), mode)

    finished: dict = {}

    def done(host, report):
        finished[host] = report
        prog.finished(host, report)

    events = Events(started=prog.started, step=prog.step, done=done)
    started, t0 = time.time(), time.monotonic()
    interrupted = False
    try:
        results, sched = run_fleet(
            [h.name for h in hosts],
            lambda name, cancel, step: execute_host(plans[name], defaults, cancel, step, None, kw.get("python")),
            limit=limit_n, max_fail_percent=mfp,
            timeout_for=lambda name: float(plans[name].host.vars.get("host_timeout") or default_timeout),
            events=events,
            # Ctrl-C / SIGTERM: a runbook that changes hosts puts each running host back before the report
            undo=fleet_undo(plans, defaults, kw.get("python")) if pb.changes or pb.attaches else None)
        meta.update(peak_running=sched.peak, stopped_early=sched.stopped and not sched.interrupted)
        if sched.interrupted:
            interrupted = True
            meta.update(interrupted=True)
    except KeyboardInterrupt:
        # Ctrl-C: the finished hosts' report and the retry file are still written; the rest count as not run.
        interrupted = True
        results = dict(finished)
        for h in hosts:
            if h.name not in results:
                results[h.name] = FleetHostReport(host=h.name, status=HostStatus.ERROR, error_kind="NotRun",
                                                  error="not run: interrupted (Ctrl-C) before it finished")
        meta.update(interrupted=True)
    finally:
        prog.close()
    meta.update(retry_file=retry_file)
    doc = reports.fleet_document(list(results.values()), meta, started, time.monotonic() - t0)
    if interrupted:
        doc["exit_status"], doc["exit_name"] = int(ExitStatus.INTERRUPTED), ExitStatus.INTERRUPTED.name
    status = ExitStatus(doc["exit_status"])
    try:
        if retry_file:
            reports.write(retry_file, "".join(f"{h}\n" for h in doc["fleet"]["retry"]))
        _write_extra(doc, {"json": json_out, "junit": junit_out, "markdown": md_out, "html": html_out})
    except UsageError as e:
        status = status if status != ExitStatus.OK else ExitStatus.USAGE
        click.echo(f"mla-doctor: error: {e} (the audit ended {doc['overall']}, exit {doc['exit_status']})", err=True)
    text = reports.render(doc, fmt, terminal_width(output))
    if output:
        status = write_output(output, text, status, doc["overall"])
    else:
        click.echo(text, nl=False)
    if interrupted:
        click.echo(f"mla-doctor: interrupted: {len(finished)} of {len(hosts)} host(s) finished"
                   + (f"; retry file {retry_file}" if retry_file else ""), err=True)
    sys.exit(int(status))


def _print_plan(plans, pb, meta, fmt, output, kw) -> None:
    doc = {"tool": "mla-doctor", "version": __version__, "command": "audit", "dry_run": True,
           "fleet": meta, "hosts": []}
    for name, p in plans.items():
        hv = p.host.vars
        doc["hosts"].append({
            "host": name, "address": p.host.target, "groups": p.host.groups,
            "connect": {"connection": hv.get("connection", "ssh"),
                        "user": hv.get("user", kw.get("user")), "port": hv.get("port", kw.get("port")),
                        "identity": hv.get("identity") or list(kw.get("identity") or ()),
                        "sudo": bool(hv.get("sudo", kw.get("sudo"))),
                        "python": hv.get("python", kw.get("python"))},
            "runtime": hv.get("runtime"), "server_port": hv.get("server_port"), "api_key_env": hv.get("api_key_env"),
            "steps": [{"name": s.name, "kind": s.kind, "options": s.options, "restarts": s.restarts}
                      for s in p.steps]})
    doc = redact_tree(doc)  # secrets in -e values, runbook options or inventory vars never reach the plan
    if fmt == "json":
        text = json.dumps(doc, indent=2) + "\n"
    else:
        lines = [f"plan: playbook {pb.name} ({pb.path}) on {len(plans)} host(s) of {meta['inventory']}"
                 + (f", limit {meta['limit']}" if meta["limit"] else "") + (f", shard {meta['shard']}"
                                                                              if meta["shard"] else "")]
        if meta["restarts"]:
            lines.append(f"restarts servers: rolling, at most {meta['serial']} down at once, stop when more than "
                         f"{meta['max_fail_percent']:g}% of hosts failed")
        else:
            what = ("changes files" if pb.changes else
                    "attaches a probe to the running servers (no file changed, no restart)" if pb.attaches else
                    "read-only")
            lines.append(f"{what}: up to {meta['forks']} hosts at once")
        for h in doc["hosts"]:
            c = h["connect"]
            who = ("local (no SSH)" if c["connection"] == "local" else
                   f"{c['user'] + '@' if c['user'] else ''}{h['address']}{':' + str(c['port']) if c['port'] else ''}")
            lines.append(f"{h['host']}: {who}" + (f" groups {','.join(h['groups'])}" if h["groups"] else "")
                         + (f" python {c['python']}" if c["python"] else "") + (" sudo" if c["sudo"] else ""))
            for k, s in enumerate(h["steps"], 1):
                opts = json.dumps(s["options"], sort_keys=True) if s["options"] else ""
                lines.append(f"  {k}. {s['name']} [{s['kind']}{', restarts' if s['restarts'] else ''}] {opts}".rstrip())
        lines.append("dry run: nothing was connected to or changed")
        text = terminal.text("\n".join(lines)) + "\n"  # inventory/runbook values: no control reaches the terminal
    if output:
        reports.write(output, text)
    else:
        click.echo(text, nl=False)


# ---------------------------------------------------------------------------------- playbooks

@cli.command("playbooks")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@handle_errors("playbooks")
def playbooks_cmd(fmt):
    """List the bundled runbooks (for `audit --playbook`) and patch-target files (for `patch --targets`).

    \b
    mla-doctor playbooks
    mla-doctor playbooks --format json
    """
    items = catalog()
    if fmt == "json":
        click.echo(json.dumps({"playbooks": items}, indent=2))
        return
    click.echo("runbooks (audit --playbook NAME):")
    tags = {e["name"]: ("restarts servers" if e["restarts"] else "changes files" if e["changes"] else
                        "attaches, changes no file" if e.get("attaches") else "read-only")  # by what the steps do
            for e in items if e["kind"] == "runbook"}
    wide = max(map(len, tags.values()), default=0)  # the column fits its longest label: none reads cut
    for e in items:
        if e["kind"] == "runbook":
            click.echo(f"  {e['name']:<14} {tags[e['name']]:<{wide}}  {e['description']}")
            click.echo(f"  {'':<14} steps: {', '.join(e['steps'])}")
    targets = [e for e in items if e["kind"] == "targets"]
    if targets:
        click.echo("patch-target files (patch --targets NAME):")
        for e in targets:
            click.echo(f"  {e['name']:<14} {e['targets']} targets: {e['description']}")
    bad = [e for e in items if e["kind"] == "invalid"]
    for e in bad:
        click.echo(f"INVALID {e['path']}: {e['error']}", err=True)
    if bad:
        sys.exit(int(ExitStatus.USAGE))


# -------------------------------------------------------------------------------------- report

def _loaded(path: str) -> dict:
    """A saved report, each host with its answer (one saved before the answer was stored gets it here)."""
    from mla_doctor.host.answer import fill

    return fill(reports.load_report(path))


@cli.group("report")
def report_group():
    """Work with saved JSON reports: merge shards, render other formats."""


@report_group.command("merge")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=_FMT, default="json", show_default=True)
@output_file_option("Write to FILE instead of stdout.")
@click.option("--junit", "junit_out", type=_OUT, callback=check_writable, help="Also write JUnit XML to FILE.")
@click.option("--markdown", "md_out", type=_OUT, callback=check_writable, help="Also write Markdown to FILE.")
@click.option("--html", "html_out", type=_OUT, callback=check_writable, help="Also write the HTML page to FILE.")
@click.option("--retry-file", type=_OUT, callback=check_writable, help="Write the hosts that did not pass to FILE.")
@handle_errors("report merge")
def report_merge(files, fmt, output, junit_out, md_out, html_out, retry_file):
    """Combine shard reports (`audit --shard I/N --format json`) into one; exit with the worst host's status.
    A shard whose audit failed as a whole makes the result an error, never OK.

    \b
    mla-doctor report merge shard*.json --html fleet.html --junit fleet.xml -o fleet.json
    """
    with reports.saved(list(files)):  # another machine's file: a wrong type in it is a usage error
        doc = reports.merge([(f, _loaded(f)) for f in files])
        texts = {k: reports.render(doc, k) for k, v in (("junit", junit_out), ("markdown", md_out),
                                                         ("html", html_out)) if v}
        text = reports.render(doc, fmt, terminal_width(output))
    if retry_file:
        reports.write(retry_file, "".join(f"{h}\n" for h in doc["fleet"]["retry"]))
    _write_extra(doc, {"junit": junit_out, "markdown": md_out, "html": html_out}, texts)
    if output:
        reports.write(output, text)
    else:
        click.echo(text, nl=False)
    sys.exit(int(doc["exit_status"]))


@report_group.command("render")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=_FMT, default="text", show_default=True)
@output_file_option("Write to FILE instead of stdout.")
@handle_errors("report render")
def report_render(file, fmt, output):
    """Render a saved JSON fleet report as text, Markdown, JUnit XML or HTML.

    \b
    mla-doctor report render fleet.json --format html -o fleet.html
    """
    with reports.saved([file]):  # another machine's file: a wrong type in it is a usage error
        doc = _loaded(file)
        if "fleet" not in doc:
            doc = reports.finish(doc)
        text = reports.render(doc, fmt, terminal_width(output))
    if output:
        reports.write(output, text)
    else:
        click.echo(text, nl=False)
