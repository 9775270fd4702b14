"""The scale-out examples' own command lines, run as their engines would (dry run: nothing is contacted).

Every engine's N shard tasks together must plan every selected host exactly once; the merge line must be
valid. The real audits of shards run in parallel and merged are in tests/integration/test_fleet_audit.py."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.support import scale_out

HOSTS = [f"gpu-{i:02d}" for i in range(1, 12)]  # 11: shards of unequal size


@pytest.fixture()
def inventory(tmp_path):
    doc = {"vars": {"user": "root"}, "hosts": {h: {"address": "127.0.0.1", "port": 9} for h in HOSTS},
           "groups": {"canary": {"hosts": ["gpu-01"]}}}
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.mark.parametrize("engine", sorted(scale_out.ENGINES))
@pytest.mark.parametrize("n", [1, 4])
def test_each_engine_plans_every_host_exactly_once(engine, n, inventory, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {"INVENTORY": str(inventory), "OUT": str(out), "KNOWN_HOSTS": str(tmp_path / "known_hosts")}
    procs = scale_out.start_shards(engine, n, tmp_path, env, ["--dry-run"])
    planned = []
    for p in procs:
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se[-2000:]
    for f in sorted(list(out.glob("shard-*.json")) + list(tmp_path.glob("shard-*.json"))):
        doc = json.loads(f.read_text())
        assert doc["dry_run"] is True
        planned.append([h["host"] for h in doc["hosts"]])
    assert len(planned) == n
    flat = [h for shard in planned for h in shard]
    assert sorted(flat) == HOSTS  # disjoint, and together every host
    assert all(shard for shard in planned)  # no empty shard with 11 hosts over <= 4 shards


@pytest.mark.parametrize("engine", sorted(scale_out.ENGINES))
def test_each_engine_marks_a_shard_and_a_merge_line(engine):
    shard, merge = scale_out.command(engine, "shard"), scale_out.command(engine, "merge")
    assert shard.startswith("mla-doctor audit ") and "--shard" in shard and "--format json" in shard
    assert merge.startswith("mla-doctor report merge ") and "shard-" in merge
