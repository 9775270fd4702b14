"""The probe's restore never puts the original back over an attribute someone else replaced since the probe
wrapped it: the real probe (the controller's template) injected by the agent's code with the real gdb into a
real CPython; after the wrap, the process itself replaces one wrapped method (a hot-fix, another tool's
wrapper); when the lease ends, that attribute is left as the process set it and the detached record names it,
while the other wrapped method is restored."""
from __future__ import annotations

import hashlib
import json
import os

from mla_doctor.agent.attach import inject
from tests.unit.test_attach_probe import gdb_or_fail, records, render, start_target, stop, wait_for, write_probe

REPLACE = ("import sys; m = sys.modules['fakemla']\n"
           "def theirs(self, *a, **k):\n"
           "    return ('theirs', 0)\n"
           "m.MLACommonImpl.forward_mha = theirs; m._theirs = theirs\n")


def test_an_attribute_replaced_after_the_wrap_is_left_as_found_and_named(tmp_path):
    gdb = gdb_or_fail()
    p, _log = start_target(tmp_path)
    run = tmp_path / "run"
    verdict = tmp_path / "verdict.json"
    try:
        data = render(run, ttl=120.0)
        path = write_probe(run, data)
        code = inject.bootstrap(str(path), hashlib.sha256(data).hexdigest(), len(data), os.geteuid())
        assert inject.inject(gdb, p.pid, code)[0]
        wait_for(lambda: any(r["event"] == "attached" for r in records(run)), what="attached")
        assert inject.inject(gdb, p.pid, REPLACE)[0]
        (run / "lease.json").write_text(json.dumps({"expires": 1, "ttl": 0, "epoch": 0, "detach": True}))
        det = wait_for(lambda: [r for r in records(run) if r["event"] == "detached"], what="detached")[0]
        look = ("import json, sys; m = sys.modules['fakemla']; d = m.MLACommonImpl.__dict__\n"
                "json.dump({'mha_theirs': d['forward_mha'] is m._theirs,\n"
                "           'mqa_plain': not hasattr(d['forward_mqa'], '__mla_doctor__')}, open(%r, 'w'))\n"
                % str(verdict))
        assert inject.inject(gdb, p.pid, look)[0]
        wait_for(verdict.exists, what="the look at the class")
    finally:
        stop(tmp_path)
        p.wait(30)
    assert json.loads(verdict.read_text()) == {"mha_theirs": True, "mqa_plain": True}
    assert det["still_wrapped"] == ["MLACommonImpl.forward_mha"] and det["restored"] == 1, det
