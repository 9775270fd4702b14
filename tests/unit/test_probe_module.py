"""The probe module as rendered from templates/probe_module.py.j2, imported and driven in-process."""
import importlib.util
import json
import os

from mla_doctor.diagnosis.evidence import PromptObservation, observe
from mla_doctor.host.instrument import Templates


class Tensor:
    def __init__(self, rows):
        self.shape = (rows, 4)


class Attn:
    layer_name = "model.layers.3.self_attn.attn"


def load_probe(tmp_path, max_detail=2):
    records = tmp_path / "records"
    records.mkdir()
    lease = tmp_path / "lease.json"
    src = Templates().render("probe_module.py.j2", run_id="t1", records_dir=str(records),
                             lease_path=str(lease), max_detail=max_detail, flush_s=0)
    path = tmp_path / "mla_doctor_probe_t1.py"
    path.write_text(src)
    return path, records, lease


def import_probe(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read(records):
    out = []
    for p in records.glob("*.jsonl"):
        out += [json.loads(line) for line in p.read_text().splitlines()]
    return out


def test_inert_without_lease_then_records_with_layers_epochs_and_counters(tmp_path):
    path, records, lease = load_probe(tmp_path)
    probe = import_probe(path)
    probe.record("p", "prefill", "X.forward_mha", {"q": Tensor(5)})
    assert read(records) == []  # no lease: inert, not even "armed"
    lease.write_text(json.dumps({"expires": 0, "epoch": 1}))
    os.utime(lease, ns=(1, 1))
    probe = import_probe(path)  # a fresh import: "armed"
    # a dispatch on the layer, then forward_mha(self=impl) without a layer of its own
    probe.record("d", "dispatch", "MLAAttention.forward_impl", {"self": Attn(), "q": Tensor(5),
                                                                 "num_mha_tokens": 5, "num_mqa_tokens": 0})
    probe.record("p", "prefill", "MLACommonBaseImpl.forward_mha", {"self": object(), "q": Tensor(5)})
    probe.record("m", "decode", "CPUMLAImpl.forward_mqa", {"q": (Tensor(1), Tensor(1)), "layer": Attn()})
    for _ in range(3):  # past the detail budget (2): counters
        probe.record("m", "decode", "CPUMLAImpl.forward_mqa", {"q": "no shape", "layer": Attn()})
    lease.write_text(json.dumps({"expires": 0, "epoch": 2}))  # the controller's next prompt window
    os.utime(lease, ns=(2, 2))
    probe.record("m", "decode", "CPUMLAImpl.forward_mqa", {"q": Tensor(1), "layer": Attn()})
    recs = read(records)
    assert [r["event"] for r in recs if r["epoch"] == 1][0] == "armed"
    calls = [r for r in recs if r["event"] == "call" and r["epoch"] == 1]
    prefill = [r for r in calls if r["role"] == "prefill"][0]
    assert prefill["layer"] == Attn.layer_name and prefill["layer_inferred"] is True
    assert prefill["tokens"]["q_rows"] == 5
    assert [r["tokens"].get("q_rows") for r in calls if r["role"] == "decode"] == [1, None]  # unknown, not 0
    counters = [r for r in recs if r["event"] == "counters"]
    assert counters and counters[-1]["epoch"] == 1 and counters[-1]["calls"] == 2
    assert counters[-1]["unknown_rows"] == 2
    assert [r["epoch"] for r in recs if r["event"] == "call"][-1] == 2  # a fresh budget in epoch 2
    obs = PromptObservation(name="x", prompt_tokens=5, max_tokens=1)
    observe(obs, [r for r in recs if r["epoch"] == 1], num_hidden_layers=61)
    assert obs.calls["forward_mha"].tokens_per_layer == {Attn.layer_name: 5}
    assert obs.calls["forward_mqa"].calls == 4 and obs.calls["forward_mqa"].unknown_tokens == 3
    assert obs.dispatch == [] and obs.calls["forward_mqa"].tokens == 1  # layer 3 is not layer 0


def test_expired_lease_makes_the_probe_inert(tmp_path):
    path, records, lease = load_probe(tmp_path)
    lease.write_text(json.dumps({"expires": 1.0, "epoch": 0}))  # long expired
    probe = import_probe(path)
    probe.record("p", "prefill", "X.forward_mha", {"q": Tensor(5)})
    assert read(records) == []


def test_the_class_of_a_classmethod_entry_is_recorded(tmp_path):
    """DeepSeek V4's ROCm sparse impl (vLLM 0.22) has `forward_mqa` as a classmethod: its locals hold `cls`, not
    `self`; the record names that class, as it does an instance's."""
    path, records, lease = load_probe(tmp_path)
    lease.write_text(json.dumps({"expires": 0, "epoch": 1}))
    probe = import_probe(path)

    class DeepseekV4ROCMAiterMLASparseImpl:
        pass

    probe.record("m", "decode", "DeepseekV4ROCMAiterMLASparseImpl.forward_mqa",
                 {"cls": DeepseekV4ROCMAiterMLASparseImpl, "q": Tensor(1), "layer": Attn()})
    probe.record("p", "prefill", "MLACommonBaseImpl.forward_mha", {"self": Attn(), "q": Tensor(5)})
    probe.record("x", "prefill", "f", {"cls": "not a class", "q": Tensor(5)})
    calls = [r for r in read(records) if r["event"] == "call"]
    assert [r["class"] for r in calls] == ["DeepseekV4ROCMAiterMLASparseImpl", "Attn", None]
