"""GPUs as nvidia-smi reports them (absent without nvidia-smi).
"""
from __future__ import annotations

import csv
import io

from ..common import _int_or_none, _run, _which


def gpu_section():
    smi = _which("nvidia-smi")
    if not smi:
        return {"present": False, "reason": "nvidia-smi not on PATH"}
    rc, out, err = _run([smi, "--query-gpu=index,name,compute_cap,memory.used,memory.total",
                         "--format=csv,noheader,nounits"], timeout=15)
    if rc != 0:
        return {"present": False, "reason": "nvidia-smi failed: %s" % err.strip()[:200]}
    gpus = []
    for row in csv.reader(io.StringIO(out)):
        row = [c.strip() for c in row]
        if len(row) >= 5:
            gpus.append({"index": _int_or_none(row[0]), "name": row[1], "compute_cap": row[2],
                         "memory_used_mib": _int_or_none(row[3]), "memory_total_mib": _int_or_none(row[4])})
    return {"present": bool(gpus), "gpus": gpus}
