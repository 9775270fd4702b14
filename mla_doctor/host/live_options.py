"""What a live run may do: the options of `mla-doctor run` and of a playbook's live step, built in one place."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mla_doctor.host.fields import NUM, option
from mla_doctor.host.runtimes import KINDS
from mla_doctor.paths import DEFAULT_RUN_ROOT

RUNTIMES = KINDS  # host/runtimes.py: what each can do
DEFAULT_PROMPTS = ("short", "long", "chunked")  # chunked: only where chunked prefill is on
DEFAULT_DEBUG_ENV = {"VLLM_LOGGING_LEVEL": "DEBUG"}


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
    debug_env: dict[str, str] = option(runbook=dict, key="debug", factory=lambda: dict(DEFAULT_DEBUG_ENV))
    force: bool = option(False, runbook=bool, cli={"help": "Restart even if the server is serving requests."})
    api_key_env: str | None = option(None, runbook=str, cli={
        "metavar": "NAME", "help": "Environment variable holding the server's API key."})
    expect: dict[str, str] = option(runbook=dict, factory=dict)
    run_root: str = option(DEFAULT_RUN_ROOT, runbook=str, cli={})
    # e.g. ("--enforce-eager",): an explicit second configuration; in a runbook raw server arguments, or
    # settings by name {enforce_eager: on, ...}
    second_pass: tuple[str, ...] = option((), runbook=(list, dict))
    # the same by name ({"enforce_eager": "on", "prefix_caching": "off"}), in the form the release accepts
    second_pass_settings: dict[str, str] = field(default_factory=dict)
    runtime: str = "process"
    keep_going_on_fail: bool = False
    start_command: str | None = None  # runtime "command": the user's own start/stop commands
    stop_command: str | None = None
    log_file: str | None = None  # where the start command's server logs
    unit: str | None = None  # runtime "systemd": the unit (default: the one the server runs in)
    container: str | None = None  # runtime "docker": the container (default: the one running vLLM)

    @classmethod
    def build(cls, *, runtime: str = "process", method: str | None = None, force: Any = False,
              api_key_env: str | None = None, debug_env: Mapping[str, Any] | None = None,
              ready_timeout: Any = None, ttl: Any = None, expect: Mapping[str, str] | None = None,
              max_tokens: Any = 3, run_root: str | None = None, prompts: str | Sequence[str] | None = None,
              second_pass: Sequence[str] | Mapping[str, Any] | None = None, start_command: str | None = None,
              stop_command: str | None = None, log_file: str | None = None, unit: str | None = None,
              container: str | None = None) -> RunOptions:
        """The one place run options are made (`mla-doctor run` and a playbook's live step). None keeps the
        default; `prompts` is "short,long" or a sequence (an empty one: the default); `debug_env` replaces
        the default settings; `second_pass` is server arguments (a sequence) or settings by name (a mapping)."""
        sp_args: tuple[str, ...] = ()
        sp_settings: dict[str, str] = {}
        if isinstance(second_pass, Mapping):
            sp_settings = {str(k): str(v) for k, v in second_pass.items()}
        elif isinstance(second_pass, (list, tuple)):
            sp_args = tuple(second_pass)
        if isinstance(prompts, str):
            names = tuple(p.strip() for p in prompts.split(",") if p.strip())
        else:
            names = tuple(prompts or DEFAULT_PROMPTS)
        return cls(runtime=runtime, method=method or "attach", force=bool(force), api_key_env=api_key_env,
                   debug_env={str(k): str(v) for k, v in (debug_env or DEFAULT_DEBUG_ENV).items()},
                   ready_timeout=float(ready_timeout) if ready_timeout is not None else cls.ready_timeout,
                   ttl=float(ttl) if ttl is not None else cls.ttl, expect=dict(expect or {}),
                   max_tokens=int(max_tokens), run_root=run_root or DEFAULT_RUN_ROOT, prompts=names,
                   second_pass=sp_args, second_pass_settings=sp_settings, start_command=start_command,
                   stop_command=stop_command, log_file=log_file, unit=unit, container=container)
