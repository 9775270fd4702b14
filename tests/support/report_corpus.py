"""A corpus of reports for proving a refactor keeps the JSON contract and the renderings byte for byte.

    python tests/support/report_corpus.py inputs DIR    # once, before the change: the cases' agent answers
    python tests/support/report_corpus.py render DIR OUT  # before and after each step; then diff -r OUT1 OUT2

`inputs` freezes the agent answers the cases are built from (recorded answers with their GPU, log and model
varied; every corpus release's real index put in the recording's place; the saved reports of the fixtures), so a
change elsewhere in the agent (which the corpus tier's cache keys on) cannot move the baseline. `render` builds
each case's report with the controller as it is now (build_static_report, the answer attached) and writes its
JSON (RunReport.to_dict, the time fixed), its text at several widths and -v levels, and the fleet writers'
text/markdown/junit/html; each saved report (JSON) is rendered too, as stored and with its answers removed
(filled on reading). The generated files are large: keep them under /tmp, not in the tree."""
from __future__ import annotations

import copy
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

H100 = {"present": True, "gpus": [{"name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0"}]}
B200 = {"present": True, "gpus": [{"name": "NVIDIA B200", "compute_cap": "10.0"}]}
SM120 = {"present": True, "gpus": [{"name": "NVIDIA RTX PRO 6000", "compute_cap": "12.0"}]}
NO_GPU = {"present": False, "gpus": []}
GPUS = {"recorded": None, "nogpu": NO_GPU, "h100": H100, "b200": B200, "sm120": SM120}
DSV32 = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "num_attention_heads": 128,
         "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
         "index_topk": 2048}
DSV3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_attention_heads": 128,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": 32}


def _log(path: Path) -> dict:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return {"found": True, "source": str(path.name), "total_lines": len(lines),
            "lines": [{"n": i + 1, "text": t, "ids": []} for i, t in enumerate(lines)]}


def inputs() -> dict:
    from mla_doctor.diagnosis.knowledge import load_knowledge
    from tests.support import corpus
    from tests.support.fake_agent import load
    from tests.unit.test_report_sections import ANSWERS

    cases: dict[str, dict] = {}
    for name, ans in ANSWERS.items():
        for g, gpu in GPUS.items():
            a = copy.deepcopy(ans)
            if gpu is not None:
                a["gpu"] = gpu
            cases[f"{name}|{g}"] = a
    base = ANSWERS["static_local[0]"]
    logs = sorted((ROOT / "tests/fixtures/real_logs").glob("*.log")) + sorted((ROOT / "tests/fixtures/logs").glob(
        "*.log"))
    for p in logs:
        for g in ("recorded", "h100", "b200"):
            a = copy.deepcopy(base)
            a["log"] = _log(p)
            if GPUS[g] is not None:
                a["gpu"] = GPUS[g]
            cases[f"log {p.name}|{g}"] = a
    for mname, cfg in (("dsv32", DSV32), ("dsv3", DSV3), ("llama", LLAMA)):
        for g in ("nogpu", "h100", "b200"):
            for key in ("static_local[0]", "static_local[0] no log", "static_local[0] no server"):
                a = copy.deepcopy(ANSWERS[key])
                a["model"] = dict(a.get("model") or {}, config=cfg)
                a.pop("resolution", None)
                a["gpu"] = GPUS[g]
                cases[f"model {mname}|{key}|{g}"] = a
    req = load_knowledge().agent_request()
    trees = sorted(p.name for p in corpus.cache_root().joinpath("vllm-src").iterdir()) if hasattr(
        corpus, "cache_root") else []
    for dist, version in corpus.RELEASES:
        if trees and f"{dist}-{version}" not in trees:
            continue
        try:
            idx = corpus.agent_index(dist, version, req)
        except Exception as e:  # a release not cached here: the corpus says so and goes on
            print(f"skip {dist} {version}: {e}", file=sys.stderr)
            continue
        tree = corpus.ensure(dist, version)
        for g in ("h100", "nogpu", "b200"):
            for logname in ("none", "flashmla"):
                a = copy.deepcopy(base)
                a.update(vllm=idx["vllm"], scan=idx["scan"], index=idx["index"], side_code=idx["side_code"],
                         gpu=GPUS[g], servers=[])
                a.pop("resolution", None)
                a["locate"]["dir"] = str(tree / "vllm")
                a["log"] = ({"found": False, "reason": "no server"} if logname == "none" else
                            {"found": True, "source": "server.log", "total_lines": 1, "lines": [
                                {"n": 1, "text": "INFO 09-01 10:00:00 [cuda.py:1] Using FlashMLA backend on V1 "
                                                 "engine.", "ids": []}]})
                cases[f"release {dist}-{version}|{g}|{logname}"] = a
    saved = {name: load(name)["report"] for name in ("static_local", "run_local")}
    return {"cases": cases, "saved": saved}


def _write(out: Path, name: str, text: str) -> None:
    safe = "".join(c if c.isalnum() or c in "-_.[]" else "_" for c in name)
    (out / safe).write_text(text, encoding="utf-8")


def render(inp: dict, out: Path) -> int:
    from mla_doctor.diagnosis.knowledge import load_knowledge
    from mla_doctor.host.answer import attach, fill
    from mla_doctor.host.audit import build_static_report
    from mla_doctor.reports import fleet_document, render as render_doc
    from mla_doctor.reports.host_text import render as render_text
    from mla_doctor.results import RunReport

    out.mkdir(parents=True, exist_ok=True)
    kb = load_knowledge()
    n = 0
    reports = []
    for name, raw in sorted(inp["cases"].items()):
        rep = build_static_report("gpu-1", copy.deepcopy(raw), kb)
        if rep.answer is None and rep.status.value == "ok":
            attach(rep, kb)
        rep.timings = {}
        run = RunReport("static", [rep], started=0.0)
        _write(out, name + ".json", json.dumps(run.to_dict(), indent=2, ensure_ascii=False))
        text = "".join(f"--- width {w} -v{v}\n" + render_text(run, verbose=v, width=w)
                       for w in (0, 100, 60) for v in (0, 1, 2))
        _write(out, name + ".txt", text)
        reports.append((name, rep))
        n += 1
    # the fleet writers, 20 hosts a document
    for i in range(0, len(reports), 20):
        chunk = []
        for j, (_name, rep) in enumerate(reports[i:i + 20]):
            r = copy.copy(rep)
            r.host = f"h{j:02d}"
            chunk.append(r)
        doc = fleet_document(chunk, {"inventory": "corpus"}, 0.0, 0.0)
        for fmt in ("json", "text", "markdown", "junit", "html"):
            _write(out, f"fleet{i // 20:03d}.{fmt}", render_doc(copy.deepcopy(doc), fmt, width=100))
            n += 1
        bare = copy.deepcopy(doc)
        for h in bare["hosts"]:
            h.pop("answer", None)
        fill(bare)
        _write(out, f"fleet{i // 20:03d}.filled.json", json.dumps(bare, indent=2, ensure_ascii=False))
    for name, doc in inp["saved"].items():
        for variant in ("stored", "filled"):
            d = copy.deepcopy(doc)
            if variant == "filled":
                for h in d["hosts"]:
                    h.pop("answer", None)
                fill(d)
            for fmt in ("json", "text", "markdown", "junit", "html"):
                _write(out, f"saved {name} {variant}.{fmt}", render_doc(copy.deepcopy(d), fmt, width=100))
                n += 1
    return n


def main(argv: list[str]) -> int:
    if argv[:1] == ["inputs"] and len(argv) == 2:
        Path(argv[1]).mkdir(parents=True, exist_ok=True)
        data = inputs()
        with gzip.open(Path(argv[1]) / "inputs.json.gz", "wt", encoding="utf-8") as f:
            json.dump(data, f)
        print(f"{len(data['cases'])} cases, {len(data['saved'])} saved reports")
        return 0
    if argv[:1] == ["render"] and len(argv) == 3:
        with gzip.open(Path(argv[1]) / "inputs.json.gz", "rt", encoding="utf-8") as f:
            data = json.load(f)
        print(f"{render(data, Path(argv[2]))} reports rendered")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
