"""GPUs as nvidia-smi reports them (absent without nvidia-smi).
"""
from __future__ import annotations

import csv
import io

from ..common import int_or_none, run_argv, find_executable


def gpu_section():
    smi = find_executable("nvidia-smi")
    if not smi:
        return {"present": False, "reason": "nvidia-smi not on PATH"}
    rc, out, err = run_argv([smi, "--query-gpu=index,name,compute_cap,memory.used,memory.total",
                         "--format=csv,noheader,nounits"], timeout=15)
    if rc != 0:
        return {"present": False, "reason": "nvidia-smi failed: %s" % err.strip()[:200]}
    gpus = []
    for row in csv.reader(io.StringIO(out)):
        row = [c.strip() for c in row]
        if len(row) >= 5:
            gpus.append({"index": int_or_none(row[0]), "name": row[1], "compute_cap": row[2],
                         "memory_used_mib": int_or_none(row[3]), "memory_total_mib": int_or_none(row[4])})
    return {"present": bool(gpus), "gpus": gpus}
