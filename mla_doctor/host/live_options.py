"""What a live run may do: the options of `mla-doctor run` and of a playbook's live step, built in one place."""
from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mla_doctor.errors import UsageError
from mla_doctor.host.fields import NUM, option
from mla_doctor.host.runtimes import KINDS
from mla_doctor.paths import DEFAULT_RUN_ROOT
from mla_doctor.safety import check_env_name

RUNTIMES = KINDS  # host/runtimes.py: what each can do
DEFAULT_PROMPTS = ("short", "long", "chunked")  # chunked: only where chunked prefill is on
DEFAULT_DEBUG_ENV = {"VLLM_LOGGING_LEVEL": "DEBUG"}


def parse_expect(text: str | None) -> dict[str, str]:
    """`run --expect prefill=mha,decode=mqa`."""
    from mla_doctor.diagnosis.live_verdict import parse_expect as parse

    if not text:
        return {}
    try:
        return parse(text)
    except ValueError as e:
        raise UsageError(f"--expect: {e}") from e


def parse_env(items: Sequence[str] | None) -> dict[str, str]:
    """`run --env KEY=VALUE ...`: the instrumented server's settings, over the default debug ones."""
    env = dict(DEFAULT_DEBUG_ENV)
    for item in items or ():
        k, sep, v = item.partition("=")
        if not sep or not k.isidentifier():
            raise UsageError(f"--env {item!r}: expected KEY=VALUE")
        env[k] = v
    return env


def second_pass(text: str | None) -> tuple[str, ...] | dict[str, str]:
    """`run --second-pass`: '--enforce-eager --max-num-seqs 8' (server arguments) or
    'enforce_eager=on,prefix_caching=off' (settings by name, checked against the knowledge)."""
    text = (text or "").strip()
    if not text or text.startswith("-"):
        return tuple(shlex.split(text))
    from mla_doctor.diagnosis.knowledge import load_knowledge

    known = load_knowledge().server_setting_names()
    settings = {}
    for item in text.split(","):
        k, sep, v = item.strip().partition("=")
        if not sep or k not in known or v.lower() not in ("on", "off", "true", "false"):
            raise UsageError(f"--second-pass {item.strip()!r}: expected NAME=on|off with NAME one of "
                             f"{', '.join(known)}, or server arguments starting with '-'")
        settings[k] = v
    return settings


def _second_pass_value(text: str | None) -> list[str] | dict[str, str]:
    sp = second_pass(text)
    return sp if isinstance(sp, dict) else list(sp)


@dataclass
class RunOptions:
    """The live step (`mla-doctor run`, a runbook's `live:`): each option declared once here, its runbook key
    and type, its range and its click option derived from the field (host/fields.py)."""

    # `run` and a runbook's live step attach by default (no restart; refused before anything changes where
    # the host does not allow it, naming the restart-based fix); `method: patch` restarts
    method: str = option("attach", runbook=str, choices=("attach", "patch", "plugin"), cli={
        "default": "attach", "help": "attach: inject the probe into the running server (no restart, no file "
                                     "changed). patch/plugin: restart the server twice (--yes)."})
    prompts: tuple[str, ...] = option(DEFAULT_PROMPTS, runbook=(list, str), cli={
        "default": ",".join(DEFAULT_PROMPTS),
        "help": "Prompt set: short (1 token), long (above every decode threshold), chunked (beyond "
                "max_num_batched_tokens, sent only where chunked prefill is on); sparse prompts on both sides "
                "of index_topk are added where the release switches there."})
    max_tokens: int = option(3, runbook=int, minimum=1, cli={"help": "Output tokens per prompt."})
    ready_timeout: float = option(900.0, runbook=NUM, above=0, cli={"help": "Seconds to wait for the model to load."})
    ttl: float = option(120.0, runbook=NUM, above=0, cli={  # lease; renewed while the run is alive
        "help": "Lease seconds (> 0); renewed while the run is alive, the host's watchdog restores after it."})
    # a cli "parse" turns the flag's text into the runbook's value (None given: parse(None), the default)
    debug_env: dict[str, str] = option(runbook=dict, key="debug", factory=lambda: dict(DEFAULT_DEBUG_ENV), cli={
        "flag": "--env", "dest": "extra_env", "multiple": True, "metavar": "KEY=VALUE", "parse": parse_env,
        "help": "Extra environment for the instrumented server (besides VLLM_LOGGING_LEVEL=DEBUG)."})
    force: bool = option(False, runbook=bool, cli={"help": "Restart even if the server is serving requests."})
    api_key_env: str | None = option(None, runbook=str, cli={
        "metavar": "NAME", "help": "Environment variable holding the server's API key."})
    expect: dict[str, str] = option(runbook=dict, factory=dict, cli={
        "metavar": "prefill=mha,decode=mqa", "parse": parse_expect,
        "help": "Runbook expectations: unmet ones are a fault (exit 1)."})
    run_root: str = option(DEFAULT_RUN_ROOT, runbook=str, cli={})
    # e.g. ("--enforce-eager",): an explicit second configuration; in a runbook raw server arguments, or
    # settings by name {enforce_eager: on, ...}
    second_pass: tuple[str, ...] = option((), runbook=(list, dict), cli={
        "dest": "second_pass_text", "metavar": "ARGS|SETTINGS", "parse": _second_pass_value,
        "help": "An explicit second configuration: restart with it and send the prompts again, reported apart "
                "from the production pass. Server arguments ('--enforce-eager') or settings by name, written "
                "in the form the installed release accepts ('enforce_eager=on,prefix_caching=off')."})
    # the same by name ({"enforce_eager": "on", "prefix_caching": "off"}), in the form the release accepts
    second_pass_settings: dict[str, str] = field(default_factory=dict)
    # How the server runs: command-line options (a fleet host's inventory vars), not a runbook's live keys
    # (no `runbook` type: the click value goes to Live.make as how the server runs)
    runtime: str = option("process", choices=tuple(KINDS), cli={
        "help": "How the server is stopped and started: process (found in /proc, relaunched "
        "detached as found), systemd (a runtime drop-in + systemctl, logs from the journal), docker (files "
        "patched inside the container via docker exec, docker restart, docker logs) or command (your "
        "--start-command / --stop-command)."})
    keep_going_on_fail: bool = False
    start_command: str | None = option(None, cli={  # runtime "command": the user's own start/stop commands
        "metavar": "CMD",
        "help": "runtime command: starts the server (run with /bin/sh -c; the run's settings arrive in its "
                "environment)."})
    stop_command: str | None = option(None, cli={"metavar": "CMD", "help": "runtime command: stops the server."})
    log_file: str | None = option(None, cli={  # where the start command's server logs
        "metavar": "PATH", "help": "runtime command: the file the started server logs to."})
    unit: str | None = option(None, cli={
        "metavar": "UNIT", "help": "runtime systemd: the unit (default: the unit the server runs in)."})
    container: str | None = option(None, cli={
        "metavar": "NAME|ID", "help": "The container the server runs in: a docker or podman name or id, a containerd "
        "id, or a Kubernetes pod's container as CONTAINER, POD/CONTAINER or NAMESPACE/POD/CONTAINER (read from the "
        "runtime's labels on the node). Attach: the server in it; runtime docker: the container restarted "
        "(default: the one running vLLM)."})

    def __post_init__(self) -> None:
        """The values as given by the command line or a runbook, in their one form: `prompts` "short,long" or a
        sequence (empty: the default); `debug_env` replaces the default settings; `second_pass` server arguments
        (a sequence) or settings by name (a mapping, kept in `second_pass_settings`); None keeps the default."""
        if self.api_key_env is not None:  # a name, checked before anything runs ('X;touch canary' is exit 2)
            check_env_name(self.api_key_env, "--api-key-env")
        if isinstance(self.second_pass, Mapping):
            self.second_pass_settings = {str(k): str(v) for k, v in self.second_pass.items()}
            self.second_pass = ()
        else:  # anything but a sequence of arguments: none
            self.second_pass = tuple(self.second_pass) if isinstance(self.second_pass, (list, tuple)) else ()
        if isinstance(self.prompts, str):
            self.prompts = tuple(p.strip() for p in self.prompts.split(",") if p.strip())
        else:
            self.prompts = tuple(self.prompts or DEFAULT_PROMPTS)
        self.method = self.method or "attach"
        self.force = bool(self.force)
        self.debug_env = {str(k): str(v) for k, v in (self.debug_env or DEFAULT_DEBUG_ENV).items()}
        self.ready_timeout, self.ttl = float(self.ready_timeout), float(self.ttl)
        self.expect, self.max_tokens = dict(self.expect or {}), int(self.max_tokens)
        self.run_root = self.run_root or DEFAULT_RUN_ROOT
