"""A small model of a vLLM server's process life, read from its log: which process died (API server, engine
core, worker), by what (an exception, a signal, an OOM, a C++ abort) and why (the line that names the cause),
or whether it was stopped on purpose (a requested shutdown). Pure; imports nothing of the reader's.

vLLM runs up to three kinds of process: the API server (the front end: ``vllm serve``, ``LLM(...)`` in a
script), the engine core (V1's ``EngineCore``, V0's ``MQLLMEngine``) and its workers (``Worker_TP0``,
``VllmWorker``, V0's ``VllmWorkerProcess``, Ray's ``RayWorkerWrapper``). A failure travels up that chain: the
process where it happened logs its traceback, the one above logs that its child died (``WorkerProc hit an
exception``, ``Worker failed``) and the front end ends with a wrapper (``EngineDeadError``, ``RuntimeError:
Engine core initialization failed. See root cause above``). So:

- the CAUSE is the first exception (or abort message, or death message) in the log that is not a wrapper; a
  wrapper is the cause only when the paste holds nothing else. Which process died is read from, in order: the
  process tag of the cause's lines, the line that announces its traceback (``Process EngineCore_0:``, ``WorkerProc
  hit an exception.``, ``Exception in worker … while processing method``), the outermost vLLM frame of its
  traceback (``v1/engine/core.py`` -> engine core, ``executor/multiproc_executor.py`` -> worker, ``entrypoints/``
  -> API server), and, for a death message or wrapper, the process it names.
- the kernel's OOM KILLER (its dmesg / journalctl -k lines pasted with the log: ``Out of memory: Killed process N
  (python3)``, ``oom-kill:…,task=python3,pid=N``) is an OOM death of the process whose tag carries pid N (else
  ``unknown``); it explains a process that vanished (the shell's ``Killed``, ``died unexpectedly``). A bare
  ``Killed`` with no kernel report is a death by signal (SIGKILL: an OOM kill is likely, not proven).
- a REQUESTED SHUTDOWN is a signal the server was sent (``[shutdown] EngineCore: trigger received
  signal=SIGTERM``, ``Received SIGTERM``, Ctrl-C: ``KeyboardInterrupt``, ``^C``, ``Interrupted by user``), or a
  stop announced (``Shutting down``, ``Engine is gracefully shutting down``, systemd's ``Stopping …``) before
  anything died. Every error after it is teardown (a closing pipe, ``EngineDeadError``), never a death: the
  log of a server a colleague stopped is not a crash. A stop announced AFTER a death is the death's
  consequence, not a request.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["Life", "Death", "read_life", "announced", "process_of_tag", "process_of_frame", "frame_site",
           "shutdown_request", "ABORT_START", "ABORT_WHAT", "SIGNAL_DEATH", "KERNEL_OOM_KILL", "KERNEL_OOM_REPORT"]

# ---- process kinds: tags, frames, wording
_TAG_ENGINE = re.compile(r"^(?:EngineCore|MQLLMEngine|DPCoordinator|LLMEngine)", re.I)
_TAG_WORKER = re.compile(r"^(?:Worker|VllmWorker|WorkerProc|RayWorkerWrapper|RayWorker|NPUWorker|ray::)", re.I)
_TAG_API = re.compile(r"^(?:APIServer|ApiServer|API ?server|AsyncLLM|Frontend)", re.I)
# a frame's vLLM path (site-packages/vllm/..., a checkout's vllm/vllm/..., a plugin's vllm_ascend/...)
_FRAME_PATH = re.compile(r"^(?:\| )?File \"(?:[^\"]{0,1024}[/\\])?(?P<pkg>vllm(?:_\w{1,32})?)[/\\]"
                         r"(?P<path>[^\"]{1,512}?\.py)\", line (?P<line>\d{1,7})")
_OFFLINE = re.compile(r"^(?:\| )?File \"(?:[^\"]{0,1024}[/\\])?vllm[/\\]entrypoints[/\\]llm\.py\"")
_FRAME_ENGINE = re.compile(r"^(?:v1/engine/core\.py|engine/multiprocessing/engine\.py|v1/engine/coordinator\.py)$")
_FRAME_WORKER = re.compile(r"^(?:v1/executor/multiproc_executor\.py|executor/multiproc_worker_utils\.py"
                           r"|executor/ray_utils\.py|v1/executor/ray_utils\.py|worker/|v1/worker/)")
_FRAME_API = re.compile(r"^(?:entrypoints/|scripts\.py$|v1/engine/async_llm\.py$|v1/engine/llm_engine\.py$"
                        r"|engine/async_llm_engine\.py$|engine/llm_engine\.py$|v1/engine/core_client\.py$)")
# the line a process logs just before its own traceback (Python's multiprocessing, vLLM's handlers)
_ANNOUNCE = (
    (re.compile(r"^Process (?P<who>[\w.:-]{1,64}):$"), None),
    (re.compile(r"^(?:EngineCore(?:_\w+)? (?:hit an exception|encountered a fatal error)"
                r"|EngineCore failed to start|Engine background task failed)"), "engine_core"),
    (re.compile(r"^(?:WorkerProc hit an exception|Exception in worker \S{1,128} while processing method"
                r"|Error executing method \S{1,128}\. This might cause deadlock"
                r"|WorkerProc failed to start)"), "worker"),
)
# a death message names the process that died ("Worker proc VllmWorker-0 died unexpectedly", "Engine core proc
# EngineCore_DP0 died unexpectedly, shutting down client.")
_SUBJECT = ((re.compile(r"(?i)\bworker\b|\bWorkerProc\b|VllmWorker|RayWorker"), "worker"),
            (re.compile(r"(?i)\bengine[ _]?core\b|EngineCore|EngineDead|\bMQLLMEngine|engine process|"
                        r"\bEngine (?:loop|background)"), "engine_core"),
            (re.compile(r"(?i)\bAPI ?server\b|\bAPIServer\b|\bfrontend\b"), "api_server"))

# ---- how it died
ABORT_START = re.compile(r"^terminate called (?:after throwing an instance of|without an active exception|"
                         r"recursively)")
ABORT_WHAT = re.compile(r"^what\(\): {0,8}(?P<msg>\S.*)$")
_ABORT_OTHER = re.compile(r"^(?:Fatal Python error: Aborted|Aborted \(core dumped\)$|.*\bSIGABRT\b)")
SIGNAL_DEATH = re.compile(
    r"^(?:Fatal Python error: (?:Segmentation fault|Bus error|Floating point exception)"
    r"|Segmentation fault(?: \(core dumped\))?$|Bus error(?: \(core dumped\))?$|Killed$"
    r"|\*{3} (?:SIG\w{2,8}|Signal) \(?\w{0,8}\)? ?received"
    r"|!{3,} Segfault encountered"
    r"|.{0,200}\b(?:died|exited|terminated|killed) (?:with|by) (?:signal|SIG\w{2,8})"
    r"|.{0,200}\bexit ?code:? ?-(?:9|11|6|15|7|8)\b)")
_EXC_END = re.compile(r"^(?:[A-Za-z_]\w{0,63}\.){0,8}[A-Z]\w{0,80}(?:Error|Exception|Exit|Interrupt)(?::|$)")
# the loggers only one kind of process prints a traceback from (V1's engine core: core.py; the front end's)
_WHERE = {"core.py": "engine_core", "engine.py": "engine_core", "api_server.py": "api_server",
          "launcher.py": "api_server", "async_llm.py": "api_server"}   # engine.py: V0's MQLLMEngine process
_VANISHED = re.compile(r"\b(?:died|exited) unexpectedly\b")
_INTERRUPT = re.compile(r"KeyboardInterrupt|CancelledError|^SystemExit")
_OOM = re.compile(r"(?i)OutOfMemoryError|out of memory|\bOOM\b|oom[-_ ]kill|Killed process \d+")
# the kernel's OOM killer, pasted with the log (dmesg, journalctl -k): the kill names the victim's pid, which the
# process tags of the log name ("(EngineCore_DP0 pid=N)"); "X invoked oom-killer:" only starts the kernel's report
KERNEL_OOM_KILL = re.compile(
    r"^(?:(?:Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?): Killed process "
    r"(?P<pid>\d{1,10}) \((?P<name>[^)]{1,64})\)"
    r"|oom-kill:.{0,600}?,task=(?P<task>[^,]{1,64}),pid=(?P<pid2>\d{1,10}))")
KERNEL_OOM_REPORT = re.compile(r"^\S{1,64} invoked oom-killer: ")

# ---- a requested shutdown: a signal sent, Ctrl-C, a stop announced
_REQUEST_SIGNAL = re.compile(
    r"^(?:\[shutdown\] \w{1,64}: trigger received signal=(?P<sig>SIG\w{2,8})"
    r"|Received (?:signal |SIG)(?P<sig2>\w{1,8})\b|Received \d{1,3} signal"
    r"|Received (?:KeyboardInterrupt|shutdown signal)|Got Keyboard Interrupt|Interrupted by user"
    r"|\^C$|Aborted!$|KeyboardInterrupt$"
    r"|(?:Stopping|Stopped) \S{1,128}\.service\b|Gracefully stopping\b"
    r"|Caught (?:SIGTERM|SIGINT)|.{0,80}\b(?:SIGTERM|SIGINT) (?:received|caught)\b)")
_REQUEST_STOP = re.compile(
    r"^(?:Shutting down\b|Engine is gracefully shutting down|Draining in-flight requests"
    r"|Waiting for application shutdown|\[shutdown\] \w{1,64}: start\b)")


# the order among failures that are not wrappers, then time: a line announcing a traceback ("EngineCore failed to
# start.") is read after the exception line it announces, a traceback cut before its exception line last
_RANK = {"exception": 0, "abort": 0, "signal": 0, "oom": 0, "message": 0, "announce": 1, "cut": 3}


def announced(msg: str) -> Optional[str]:
    """The process kind whose traceback this line announces (``WorkerProc hit an exception.``, ``EngineCore
    failed to start.``, ``Exception in worker … while processing method …``), else None."""
    for rx, what in _ANNOUNCE:
        if what is not None and rx.match(msg):
            return what
    return None


@dataclass
class Death:
    """One failure the log shows: a fact (the exception / death / abort line), the lines of its block."""
    fact: Any                                   # the Fact of its line (kind fatal)
    start: int                                  # first line of its traceback (== fact.n when none)
    key: Tuple[Any, ...]                        # (tags, pid) of its records
    wrapper: bool = False                       # only reports that another process died
    kind: str = "exception"   # exception | oom | abort | signal | announce | message | cut (no exception line)
    victim: Optional[int] = None   # the pid the kernel's OOM killer names


@dataclass
class Life:
    died: Optional[str] = None                  # api_server | engine_core | worker | unknown | None
    died_rule: str = ""                         # how the process was told
    death_kind: Optional[str] = None            # exception | signal | oom | abort | None
    cause: Any = None                           # the Fact that says WHY (not a wrapper, when the paste has one)
    wrapper: Any = None                         # the last wrapper (EngineDeadError...), context only
    frame: Optional[str] = None                 # the innermost vLLM frame of the cause's traceback (file:line)
    shutdown: bool = False                      # a requested shutdown, before anything died
    shutdown_line: Optional[int] = None
    shutdown_text: str = ""
    shutdown_signal: Optional[str] = None
    teardown: List[Any] = field(default_factory=list)   # errors after the request: not deaths

    def to_dict(self) -> dict:
        return {"died": self.died, "died_rule": self.died_rule, "death_kind": self.death_kind,
                "cause_line": self.cause.n if self.cause is not None else None,
                "cause_frame": self.frame,
                "wrapper_line": self.wrapper.n if self.wrapper is not None else None,
                "wrapper": self.wrapper.text[:300] if self.wrapper is not None else None,
                "shutdown": self.shutdown, "shutdown_line": self.shutdown_line,
                "shutdown_text": self.shutdown_text[:300], "shutdown_signal": self.shutdown_signal,
                "teardown_lines": [f.n for f in self.teardown]}


def process_of_tag(tags: Sequence[str]) -> Optional[str]:
    """The process kind a record's process tags name (innermost first), or None."""
    for tag in reversed(tuple(tags or ())):
        for rx, kind in ((_TAG_ENGINE, "engine_core"), (_TAG_WORKER, "worker"), (_TAG_API, "api_server")):
            if rx.match(tag):
                return kind
    return None


def process_of_frame(msg: str) -> Optional[Tuple[str, str]]:
    """(process kind, vllm path) a traceback frame's file implies, or None (not a vLLM frame, or a module every
    process runs)."""
    m = _FRAME_PATH.match(msg)
    if not m:
        return None
    path = m.group("path").replace("\\", "/")
    if m.group("pkg") != "vllm":   # a platform plugin (vllm_ascend/worker/...): its worker / engine modules
        path = path if re.match(r"^(?:worker|v1/worker)/", path) else ""
    for rx, kind in ((_FRAME_ENGINE, "engine_core"), (_FRAME_WORKER, "worker"), (_FRAME_API, "api_server")):
        if path and rx.search(path):
            return kind, path
    return None


def frame_site(msg: str) -> Optional[str]:
    """``vllm/<path>:<line>`` of a vLLM traceback frame, else None."""
    m = _FRAME_PATH.match(msg)
    return "%s/%s:%s" % (m.group("pkg"), m.group("path").replace("\\", "/"), m.group("line")) if m else None


def shutdown_request(msg: str) -> Optional[Tuple[str, Optional[str]]]:
    """("signal" | "stop", the signal's name) when the message requests or announces a stop, else None."""
    m = _REQUEST_SIGNAL.match(msg)
    if m:
        sig = m.group("sig") or (("SIG" + m.group("sig2")) if m.group("sig2") else None)
        if sig is None and ("KeyboardInterrupt" in msg or "^C" in msg or "Interrupt" in msg or "Aborted!" in msg):
            sig = "SIGINT"
        return "signal", sig
    if _REQUEST_STOP.match(msg):
        return "stop", None
    return None


def _subject(text: str) -> Optional[str]:
    for rx, kind in _SUBJECT:
        if rx.search(text):
            return kind
    return None


def _process(death: Death, recs: Sequence[Any], index: Dict[int, int]) -> Tuple[str, str]:
    """(process kind, rule) of a death: its tags, its announcing line, its outermost vLLM frame, its wording."""
    f = death.fact
    if death.victim is not None:   # the kernel killed a pid: the process whose tag carries that pid
        tags = next((r.tags for r in recs if r.pid == death.victim and r.tags), None)
        kind = process_of_tag(tags or ())
        if kind:
            return kind, "the pid the kernel's OOM killer names (%d) is %s's" % (death.victim, tags[-1])
        return "unknown", "the kernel's OOM killer names pid %d, which no process tag of the log carries" % \
            death.victim
    i_end = index.get(f.n)
    i_start = index.get(death.start, i_end)
    own = [recs[i] for i in range(i_start, i_end + 1)] if i_start is not None and i_end is not None else []
    own = [r for r in own if (r.tags, r.pid) == death.key] or own
    if death.kind == "message" or death.wrapper:   # a death message / wrapper: the process it names
        who = _subject(f.text)
        if who:
            return who, "the process the %s names" % ("wrapper" if death.wrapper else "death message")
    kind = process_of_tag(own[0].tags if own else ())
    if kind:
        return kind, "the process tag of its lines (%s)" % own[0].tags[-1]
    # the line announcing the traceback (just before it, same process)
    if i_start is not None:
        for j in range(i_start, max(-1, i_start - 4), -1):
            r = recs[j]
            if (r.tags, r.pid) != death.key and j != i_start:
                continue
            for rx, what in _ANNOUNCE:
                m = rx.match(r.msg)
                if m:
                    if what is None:
                        who = process_of_tag([m.group("who")])
                        if who:
                            return who, "the line announcing its traceback (line %d)" % r.n
                        continue
                    return what, "the line announcing its traceback (line %d)" % r.n
    for r in own + _following(death, recs, i_end):   # outermost vLLM frame: the process's entry point
        if _OFFLINE.match(r.msg):   # LLM(...) in a script: no server process; V0 runs engine and worker in it
            return "unknown", "an offline LLM(...) run: the script's own process, not one of the server's"
        got = process_of_frame(r.msg)
        if got:
            return got[0], "the outermost vLLM frame of its traceback (vllm/%s)" % got[1]
    for r in own[:1]:   # the logger that printed it: V1's engine core logs its traceback from core.py
        where = (r.where or "").rsplit("/", 1)[-1].split(":", 1)[0]
        if where in _WHERE:
            return _WHERE[where], "the logger that printed its traceback ([%s])" % r.where
    who = _subject(f.text)
    if who:
        return who, "the process its message names"
    return "unknown", "no process tag, announcing line, vLLM frame, logger or message says which process"


def _no_exception(death: Death, recs: Sequence[Any], index: Dict[int, int]) -> bool:
    """The death was logged with ``logger.exception`` while no exception was active (the next line of its process
    is Python's ``NoneType: None``): nothing raised, the process vanished (killed)."""
    i = index.get(death.fact.n)
    if i is None:
        return False
    nxt = next((r for r in recs[i + 1:i + 6] if (r.tags, r.pid) == death.key), None)
    return nxt is not None and nxt.msg == "NoneType: None"


def _following(death: Death, recs: Sequence[Any], i_end: Optional[int]) -> List[Any]:
    """The traceback an announcing line (or a cut one) is followed by: the same process's next records, up to
    its exception line (bounded)."""
    if i_end is None or death.kind not in ("announce", "cut"):
        return []
    out = []
    for r in recs[i_end + 1:i_end + 400]:
        if (r.tags, r.pid) != death.key:
            continue
        out.append(r)
        if _EXC_END.match(r.msg):
            break
    return out


def _innermost_frame(death: Death, recs: Sequence[Any], index: Dict[int, int]) -> Optional[str]:
    i_end, i_start = index.get(death.fact.n), index.get(death.start)
    if i_end is None or i_start is None:
        return None
    site = None
    for j in range(i_start, i_end + 1):
        r = recs[j]
        if (r.tags, r.pid) == death.key:
            got = frame_site(r.msg)
            site = got or site
    return site


def read_life(recs: Sequence[Any], deaths: List[Death]) -> Life:
    """The process-life reading of the records (log_facts.Record) and the failures found in them, oldest first."""
    life = Life()
    index = {r.n: i for i, r in enumerate(recs)}
    deaths = sorted(deaths, key=lambda d: d.fact.n)
    # any failure, a wrapper too (an API server's EngineDeadError, then uvicorn's "Shutting down"), except the
    # interrupt a Ctrl-C raises itself
    first_death = next((d.fact.n for d in deaths if not _INTERRUPT.search(d.fact.value or d.fact.text)), None)
    since = None   # the first request: every failure after it is teardown
    for r in recs:
        if first_death is not None and r.n > first_death:
            break   # a stop after a death is its consequence (the server going down), not a request
        got = shutdown_request(r.msg)
        if got is None:
            continue
        kind, sig = got
        since = r.n if since is None else since
        if not life.shutdown or (kind == "signal" and life.shutdown_signal is None):   # the signal says most
            life.shutdown, life.shutdown_line, life.shutdown_text, life.shutdown_signal = True, r.n, r.text, sig
        if kind == "signal":
            break
    if life.shutdown:
        life.teardown = [d.fact for d in deaths if d.fact.n >= (since or 0)
                         or "KeyboardInterrupt" in (d.fact.value or "")]
        gone = {id(f) for f in life.teardown}
        deaths = [d for d in deaths if id(d.fact) not in gone]
    if not deaths:
        return life
    # the cause: the first failure that is not a wrapper; an exception / abort / signal line before the line
    # announcing it ("EngineCore failed to start.", "WorkerProc hit an exception.", a repr logged before its
    # traceback), before a death message, before a traceback the paste cut before its exception line
    def rank(d: Death) -> Tuple[bool, int, int]:
        return d.wrapper, _RANK.get(d.kind, 0), d.fact.n

    # the process that died: its first failure that is not a wrapper (a traceback the paste cut included: the
    # engine core's cut traceback still says the engine core died when only the API server's wrapper is whole)
    dead = min(deaths, key=rank)
    # the line that says why: the same order among the failures whose line is in the paste
    lined = [d for d in deaths if d.kind != "cut"]
    cause = min(lined, key=rank) if lined else None
    killed = next((d for d in deaths if d.victim is not None), None)
    if killed is not None and (dead.kind in ("signal", "message") or cause is None or cause.kind == "signal"):
        # a process that vanished (the shell's "Killed", "died unexpectedly") where the kernel's report of an OOM
        # kill is pasted too, before or after it: the kill says why
        dead = cause = killed
    wrappers = [d for d in deaths if d.wrapper]
    life.cause = cause.fact if cause is not None else None
    life.wrapper = wrappers[-1].fact if wrappers and wrappers[-1] is not cause else None
    life.died, life.died_rule = _process(dead, recs, index)
    text = dead.fact.text
    if dead.kind in ("abort", "signal", "oom"):
        life.death_kind = dead.kind
    elif _OOM.search(text) or (cause is not None and _OOM.search(cause.fact.text)):
        life.death_kind = "oom"
    elif _no_exception(dead, recs, index):   # logger.exception() with no exception: the process vanished
        life.death_kind = "signal"
    elif dead.kind == "message":   # vLLM's death messages follow an exception unless they name a signal, or
        # say the process vanished ("died unexpectedly (exit code: None)"): no Python exception, so a kill / crash
        life.death_kind = "signal" if SIGNAL_DEATH.match(text.split("] ", 1)[-1]) or _VANISHED.search(text) \
            else "exception"
    else:
        life.death_kind = "exception"
    if cause is None:
        return life
    life.frame = _innermost_frame(cause, recs, index)
    return life
