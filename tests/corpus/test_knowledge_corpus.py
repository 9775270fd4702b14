"""The knowledge, proven against the real sources of every corpus release (PyPI wheels, tests/support/corpus.py).

For each release the remote agent's ``op_index`` runs locally on the extracted tree with the one
version-independent request, and ``verify_static`` must confirm what the table below says — the
table is written by hand from reading the sources, and def lines are recomputed here with a plain
regex, independently of the agent's AST index. A release without a row in the table (added to the corpus
later) still has every entry the knowledge gives it confirmed at its `grep -n` def line; the row's exact
symbols are checked where there is one.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.static_facts import verify_static
from tests.support import corpus

pytestmark = pytest.mark.corpus

MLA = "model_executor/layers/attention/mla_attention.py"
V1C = "v1/attention/backends/mla/common.py"
B = "v1/attention/backends/mla/"
SPARSE = "model_executor/layers/attention/sparse_mla_attention.py"
SPLIT = ("split_decodes_and_prefills", "v1/attention/backends/utils.py")
DSV2 = "model_executor/models/deepseek_v2.py"
DSV32 = "models/deepseek_v32/nvidia/model.py"


def _fwd(prefix, names):
    return {n: [(c + prefix, B + f)] for n, (c, f) in names.items()}


DENSE_010 = {"TRITON_MLA": ("TritonMLAImpl", "triton_mla.py"), "FLASHMLA": ("FlashMLAImpl", "flashmla.py"),
             "CUTLASS_MLA": ("CutlassMLAImpl", "cutlass_mla.py"),
             "FLASHINFER_MLA": ("FlashInferMLAImpl", "flashinfer_mla.py"),
             "FLASH_ATTN_MLA": ("FlashAttnMLAImpl", "flashattn_mla.py"),
             "ROCM_AITER_MLA": ("AiterMLAImpl", "rocm_aiter_mla.py")}

# backend -> [(decode symbol, file holding the def)] ; one item per engine that has it (default engine first)
V0B = "attention/backends/"
BACKENDS_0_9 = {"TRITON_MLA": [("TritonMLAImpl._forward_decode", B + "triton_mla.py"),
                               ("TritonMLAImpl._forward_decode", V0B + "triton_mla.py")],
                "FLASHMLA": [("FlashMLAImpl._forward_decode", B + "flashmla.py"),
                             ("FlashMLAImpl._forward_decode", V0B + "flashmla.py")],
                "CUTLASS_MLA": [("CutlassMLAImpl._forward_decode", B + "cutlass_mla.py")],
                "ROCM_AITER_MLA": [("AiterMLAImpl._forward_decode", B + "rocm_aiter_mla.py"),
                                   ("AiterMLAImpl._forward_decode", V0B + "rocm_aiter_mla.py")],
                "CPU_MLA": [("CPUMLAImpl._forward_decode", V0B + "cpu_mla.py")]}
BACKENDS_0_11 = {**_fwd("._forward_decode", DENSE_010),
                 "FLASHMLA_SPARSE": [("FlashMLASparseImpl.forward", B + "flashmla_sparse.py")]}
# AiterTritonMLAImpl(AiterMLAImpl) inherits the decode entry: it counts by its defining file
BACKENDS_0_13 = {**BACKENDS_0_11,
                 "ROCM_AITER_TRITON_MLA": [("AiterMLAImpl._forward_decode", B + "rocm_aiter_mla.py")],
                 "ROCM_AITER_MLA_SPARSE": [("ROCMAiterMLASparseImpl.forward", B + "rocm_aiter_mla_sparse.py")]}
BACKENDS_0_16 = {**_fwd(".forward_mqa", DENSE_010),
                 "ROCM_AITER_TRITON_MLA": [("AiterMLAImpl.forward_mqa", B + "rocm_aiter_mla.py")],
                 **_fwd(".forward_mqa", {"FLASHMLA_SPARSE": ("FlashMLASparseImpl", "flashmla_sparse.py"),
                                         "ROCM_AITER_MLA_SPARSE": ("ROCMAiterMLASparseImpl",
                                                                   "rocm_aiter_mla_sparse.py")})}
BACKENDS_0_17 = {**BACKENDS_0_16, **_fwd(".forward_mqa", {"FLASHINFER_MLA_SPARSE": ("FlashInferMLASparseImpl",
                                                                                  "flashinfer_mla_sparse.py")})}
BACKENDS_0_20 = {**BACKENDS_0_17, **_fwd(".forward_mqa", {"XPU_MLA_SPARSE": ("XPUMLASparseImpl", "xpu_mla_sparse.py")})}
BACKENDS_0_21 = {**BACKENDS_0_20,
                 **_fwd(".forward_mqa", {"TOKENSPEED_MLA": ("TokenspeedMLAImpl", "tokenspeed_mla.py")})}
BACKENDS_0_24 = {**BACKENDS_0_21, **_fwd(".forward_mqa", {"FLASHINFER_MLA_SPARSE_SM120": (
    "FlashInferMLASparseSM120Impl", "flashinfer_mla_sparse_sm120.py")})}
BACKENDS_0_26 = {**BACKENDS_0_24, **_fwd(".forward_mqa", {"FLASH_ATTN_MLA_SPARSE": ("FlashAttnMLASparseImpl",
                                                                                  "flashattn_mla_sparse.py")})}
BACKENDS_0_28 = {**BACKENDS_0_26, **_fwd(".forward_mqa", {"CPU_MLA": ("CPUMLAImpl", "cpu_mla.py")})}
BACKENDS_0_29 = {**BACKENDS_0_28, **_fwd(".forward_mqa", {"AMX_MLA": ("AMXMLAImpl", "amx_mla.py")})}
BACKENDS_0_30 = {**BACKENDS_0_29, **_fwd(".forward_mqa", {"FLASHINFER_MLA_SPARSE_SM90": (
    "FlashInferMLASparseSM90Impl", "flashinfer_mla_sparse_sm90.py")})}
BACKENDS_0_32 = {**BACKENDS_0_30,
                 **_fwd(".forward_mqa", {"FLASH_ATTN_MLA_XPU": ("XPUFlashAttnMLAImpl", "flashattn_mla.py")})}
BACKENDS_0_33 = {**BACKENDS_0_32,
                 "FLASHINFER_MLA_SPARSE": [("SparseMLACommonImpl.forward_mqa", SPARSE)],
                 "FLASH_ATTN_MLA_SPARSE": [("SparseMLACommonImpl.forward_mqa", SPARSE)],
                 "FLASH_ATTN_MLA_SPARSE_FA4": [("SparseMLACommonImpl.forward_mqa", SPARSE)]}

SPARSE_HEADS = "128: 1024"  # text on the confirming line of the head-dependent FLASHMLA_SPARSE threshold
SPARSE_HEADS_FA = "128: 256"  # FLASH_ATTN_MLA_SPARSE's head table (0.26+): 256 at 128 heads on every GPU

# dispatch / dense-MHA prefill / generic decode / split, by source layout
V1_COMMON = dict(dispatch=("MLACommonImpl.forward", V1C), prefill=("MLACommonImpl._forward_prefill", V1C),
                 decode=("MLACommonImpl._forward_decode", V1C), split=SPLIT)  # 0.10.2 - 0.14
LAYER_0_16 = dict(dispatch=("MLAAttention.forward_impl", MLA), prefill=("MLACommonImpl.forward_mha", MLA),
                  decode=("MLACommonImpl.forward_mqa", MLA), split=SPLIT)  # 0.16 - 0.25: mla_attention.py
LAYER_0_26 = {**LAYER_0_16, "prefill": ("MLACommonBaseImpl.forward_mha", MLA)}  # forward_mha moved to the base

# reorder_batch_threshold per backend (queries <= it are decode); MLACommonMetadataBuilder's 1 is inherited by
# the builders without their own (Cutlass, FlashInfer, AITER, Tokenspeed, CPU, AMX)
THR_0_11_2 = {"TRITON_MLA": 1, "FLASHMLA": 128, "CUTLASS_MLA": 1, "FLASHINFER_MLA": 1, "FLASH_ATTN_MLA": 512,
              "ROCM_AITER_MLA": 1}
THR_0_13 = {**THR_0_11_2, "ROCM_AITER_TRITON_MLA": 1, "FLASHMLA_SPARSE": 1}
THR_0_21 = {**THR_0_13, "TOKENSPEED_MLA": 1}
THR_0_25 = {**THR_0_21, "FLASHINFER_MLA_SPARSE": 1, "FLASH_ATTN_MLA_SPARSE": 1}
THR_0_27 = {**THR_0_21, "FLASHMLA_SPARSE": SPARSE_HEADS, "FLASHINFER_MLA_SPARSE": SPARSE_HEADS,
            "FLASH_ATTN_MLA_SPARSE": SPARSE_HEADS_FA, "ROCM_AITER_MLA_SPARSE": 1}
THR_0_28 = {**THR_0_27, "CPU_MLA": 1}
THR_0_30 = {**THR_0_28, "AMX_MLA": 1}
FP = "FULL_AND_PIECEWISE"

EXPECTED = {
    "0.7.3": dict(
        dispatch=("MLACommonImpl.forward", "attention/backends/mla/utils.py"),
        prefill=("TritonMLAImpl._forward_prefill", "attention/backends/triton_mla.py"),
        decode=("MLACommonImpl._forward_decode", "attention/backends/mla/utils.py"),
        split=("MLACommonImpl.forward", "attention/backends/mla/utils.py"),
        backends={"TRITON_MLA": [("TritonMLAImpl._forward_decode", "attention/backends/triton_mla.py")]},
        sparse=[], thresholds={}, cudagraph="V0_FULL_DECODE"),
    "0.8.5.post1": dict(
        dispatch=("MLACommonImpl.forward", V1C), prefill=("MLACommonImpl._forward_prefill", V1C),
        decode=("MLACommonImpl._forward_decode", V1C), split=("MLACommonMetadataBuilder.reorder_batch", V1C),
        backends={"TRITON_MLA": [("TritonMLAImpl._forward_decode", B + "triton_mla.py"),
                                 ("TritonMLAImpl._forward_decode", "attention/backends/triton_mla.py")],
                  "FLASHMLA": [("FlashMLAImpl._forward_decode", B + "flashmla.py"),
                               ("FlashMLAImpl._forward_decode", "attention/backends/flashmla.py")],
                  "ROCM_AITER_MLA": [("AiterMLAImpl._forward_decode", "attention/backends/rocm_aiter_mla.py")],
                  "CPU_MLA": [("CPUMLAImpl._forward_decode", "attention/backends/cpu_mla.py")]},
        sparse=[], thresholds={"TRITON_MLA": 1, "FLASHMLA": 1}, cudagraph="PIECEWISE"),
    "0.9.2": dict(
        dispatch=("MLACommonImpl.forward", V1C), prefill=("MLACommonImpl._forward_prefill", V1C),
        decode=("MLACommonImpl._forward_decode", V1C), split=("MLACommonMetadataBuilder.reorder_batch", V1C),
        backends=BACKENDS_0_9, sparse=[],
        thresholds={"TRITON_MLA": 1, "FLASHMLA": 1, "CUTLASS_MLA": 1, "ROCM_AITER_MLA": 1}, cudagraph="PIECEWISE"),
    "0.10.2": dict(
        dispatch=("MLACommonImpl.forward", V1C), prefill=("MLACommonImpl._forward_prefill", V1C),
        decode=("MLACommonImpl._forward_decode", V1C), split=SPLIT,
        backends={**_fwd("._forward_decode", DENSE_010),
                  "TRITON_MLA": [("TritonMLAImpl._forward_decode", B + "triton_mla.py"),
                                 ("TritonMLAImpl._forward_decode", "attention/backends/triton_mla.py")],
                  "FLASHMLA": [("FlashMLAImpl._forward_decode", B + "flashmla.py"),
                               ("FlashMLAImpl._forward_decode", "attention/backends/flashmla.py")],
                  "ROCM_AITER_MLA": [("AiterMLAImpl._forward_decode", B + "rocm_aiter_mla.py"),
                                     ("AiterMLAImpl._forward_decode", "attention/backends/rocm_aiter_mla.py")]},
        sparse=[], thresholds={"TRITON_MLA": 1, "FLASHMLA": 1, "CUTLASS_MLA": 1, "FLASHINFER_MLA": 1,
                               "FLASH_ATTN_MLA": 512}, cudagraph="PIECEWISE"),
    "0.11.0": dict(
        dispatch=("MLACommonImpl.forward", V1C), prefill=("MLACommonImpl._forward_prefill", V1C),
        decode=("MLACommonImpl._forward_decode", V1C), split=SPLIT,
        backends={**_fwd("._forward_decode", DENSE_010),
                  "FLASHMLA_SPARSE": [("FlashMLASparseImpl.forward", B + "flashmla_sparse.py")]},
        sparse=[DSV2],
        thresholds={"TRITON_MLA": 1, "FLASHMLA": 1, "FLASH_ATTN_MLA": 512}, cudagraph="FULL_AND_PIECEWISE"),
    "0.11.2": dict(**V1_COMMON, backends=BACKENDS_0_11, sparse=[DSV2], thresholds=THR_0_11_2, cudagraph=FP),
    "0.12.0": dict(**V1_COMMON, backends=BACKENDS_0_13, sparse=[DSV2],
                   thresholds={**THR_0_11_2, "ROCM_AITER_TRITON_MLA": 1}, cudagraph=FP),
    "0.13.0": dict(
        dispatch=("MLACommonImpl.forward", V1C), prefill=("MLACommonImpl._forward_prefill", V1C),
        decode=("MLACommonImpl._forward_decode", V1C), split=SPLIT,
        backends=BACKENDS_0_13, sparse=[DSV2],
        thresholds={"TRITON_MLA": 1, "FLASHMLA": 128, "FLASH_ATTN_MLA": 512, "FLASHMLA_SPARSE": 1},
        cudagraph="FULL_AND_PIECEWISE"),
    "0.14.1": dict(**V1_COMMON, backends=BACKENDS_0_13, sparse=[DSV2], thresholds=THR_0_13, cudagraph=FP),
    "0.15.1": dict(
        dispatch=("MLACommonImpl.forward", MLA), prefill=("MLACommonImpl._forward_prefill", MLA),
        decode=("MLACommonImpl._forward_decode", MLA), split=SPLIT,
        backends=BACKENDS_0_13, sparse=[DSV2],
        thresholds={"TRITON_MLA": 1, "FLASHMLA": 128, "FLASH_ATTN_MLA": 512, "FLASHMLA_SPARSE": 1},
        cudagraph="FULL_AND_PIECEWISE"),
    "0.16.0": dict(**LAYER_0_16, backends=BACKENDS_0_16, sparse=[DSV2], thresholds=THR_0_13, cudagraph=FP),
    "0.17.1": dict(**LAYER_0_16, backends=BACKENDS_0_17, sparse=[DSV2], thresholds=THR_0_13, cudagraph=FP),
    "0.18.1": dict(**LAYER_0_16, backends=BACKENDS_0_20, sparse=[DSV2], thresholds=THR_0_13, cudagraph=FP),
    "0.19.1": dict(**LAYER_0_16, backends=BACKENDS_0_20, sparse=[DSV2], thresholds=THR_0_13, cudagraph=FP),
    "0.20.2": dict(
        dispatch=("MLAAttention.forward_impl", MLA), prefill=("MLACommonImpl.forward_mha", MLA),
        decode=("MLACommonImpl.forward_mqa", MLA), split=SPLIT,
        backends=BACKENDS_0_20, sparse=[DSV2],
        thresholds={"TRITON_MLA": 1, "FLASHMLA": 128, "FLASH_ATTN_MLA": 512, "FLASHMLA_SPARSE": 1},
        cudagraph="FULL_AND_PIECEWISE"),
    "0.21.0": dict(**LAYER_0_16, backends=BACKENDS_0_21, sparse=[DSV2], thresholds=THR_0_21, cudagraph=FP),
    "0.22.1": dict(**LAYER_0_16, backends=BACKENDS_0_21, sparse=[DSV2], thresholds=THR_0_21, cudagraph=FP),
    "0.23.0": dict(**LAYER_0_16, backends=BACKENDS_0_21, sparse=[DSV2], thresholds=THR_0_21, cudagraph=FP),
    "0.24.0": dict(**LAYER_0_16, backends=BACKENDS_0_24, sparse=[DSV2], thresholds=THR_0_21, cudagraph=FP),
    "0.25.1": dict(**LAYER_0_16, backends=BACKENDS_0_26, sparse=[DSV2], thresholds=THR_0_25, cudagraph=FP),
    "0.26.0": dict(
        dispatch=("MLAAttention.forward_impl", MLA), prefill=("MLACommonBaseImpl.forward_mha", MLA),
        decode=("MLACommonImpl.forward_mqa", MLA), split=SPLIT,
        backends=BACKENDS_0_26, sparse=[DSV2],
        thresholds={"TRITON_MLA": 1, "FLASHMLA": 128, "FLASH_ATTN_MLA": 512, "FLASHMLA_SPARSE": SPARSE_HEADS},
        cudagraph="FULL_AND_PIECEWISE"),
    # models/deepseek_v32 exists from 0.25.1, but the registry maps DeepseekV32ForCausalLM to deepseek_v2 until 0.29
    "0.27.1": dict(**LAYER_0_26, backends=BACKENDS_0_26, sparse=[DSV2], thresholds=THR_0_27, cudagraph=FP),
    "0.28.0": dict(**LAYER_0_26, backends=BACKENDS_0_28, sparse=[DSV2], thresholds=THR_0_28, cudagraph=FP),
    "0.29.0": dict(
        dispatch=("MLAAttention.forward_impl", MLA), prefill=("MLACommonBaseImpl.forward_mha", MLA),
        decode=("MLACommonImpl.forward_mqa", MLA), split=SPLIT,
        backends=BACKENDS_0_29, sparse=[DSV2, DSV32],
        thresholds={"TRITON_MLA": 1, "FLASHMLA": 128, "FLASH_ATTN_MLA": 512, "FLASHMLA_SPARSE": SPARSE_HEADS,
                    "CPU_MLA": 1}, cudagraph="FULL_AND_PIECEWISE"),
    "0.30.0": dict(**LAYER_0_26, backends=BACKENDS_0_30, sparse=[DSV2, DSV32], thresholds=THR_0_30, cudagraph=FP),
    "0.31.0": dict(**LAYER_0_26, backends=BACKENDS_0_30, sparse=[DSV2, DSV32], thresholds=THR_0_30, cudagraph=FP),
    "0.32.0": dict(
        dispatch=("MLAAttention.forward_impl", MLA), prefill=("MLACommonBaseImpl.forward_mha", MLA),
        decode=("MLACommonImpl.forward_mqa", MLA), split=SPLIT,
        backends=BACKENDS_0_32, sparse=[DSV2, DSV32],
        thresholds={"TRITON_MLA": 1, "FLASHMLA": 128, "FLASH_ATTN_MLA": 512, "FLASHMLA_SPARSE": SPARSE_HEADS,
                    "CPU_MLA": 1, "FLASH_ATTN_MLA_XPU": 1}, cudagraph="FULL_AND_PIECEWISE"),
    "0.33.0": dict(
        dispatch=("MLAAttention.forward_impl", MLA), prefill=("MLACommonBaseImpl.forward_mha", MLA),
        decode=("MLACommonImpl.forward_mqa", MLA), split=SPLIT,
        backends=BACKENDS_0_33, sparse=[DSV2, DSV32],
        thresholds={"TRITON_MLA": 1, "FLASHMLA": 128, "FLASH_ATTN_MLA": 512, "FLASHMLA_SPARSE": SPARSE_HEADS,
                    "CPU_MLA": 1, "FLASH_ATTN_MLA_XPU": 1}, cudagraph="FULL_AND_PIECEWISE"),
}

RELEASES = [pytest.param(d, v, id="%s-%s" % (d, v)) for d, v in corpus.RELEASES]


@lru_cache(maxsize=None)
def _run(dist: str, version: str):
    tree = corpus.ensure(dist, version)
    agent = corpus.agent_index(dist, version, load_knowledge().agent_request())
    facts = load_knowledge().for_version(agent["vllm"]["version"])
    return tree, agent, facts, verify_static(facts, agent)


def _def_line(path: Path, symbol: str):
    """`grep -n` line of `def method` inside `class Cls` (or a top-level `def func`), by plain regex."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if "." not in symbol:
        rx = re.compile(r"^(?:async\s+)?def\s+%s\s*\(" % re.escape(symbol))
        return next((i for i, ln in enumerate(lines, 1) if rx.match(ln)), None)
    cls, meth = symbol.split(".")
    start = next((i for i, ln in enumerate(lines) if re.match(r"^class\s+%s\b" % re.escape(cls), ln)), None)
    if start is None:
        return None
    for i in range(start + 1, len(lines)):
        ln = lines[i]
        if ln and not ln[0].isspace() and not ln.startswith(("#", ")")):
            return None  # left the class body
        if re.match(r"^    (?:async\s+)?def\s+%s\s*\(" % re.escape(meth), ln):
            return i + 1
    return None


def _check_ref(tree: Path, ref, symbol: str, file: str):
    assert ref is not None, symbol
    assert (ref.symbol, ref.file) == (symbol, "vllm/" + file)
    assert ref.confirmed, ref.note
    assert ref.line == _def_line(tree / ref.file, symbol) is not None


@pytest.mark.parametrize("dist, version", RELEASES)
def test_identity_and_entries(dist, version):
    tree, agent, facts, audit = _run(dist, version)
    exp = EXPECTED.get(version)
    assert agent["vllm"]["version"] == version
    assert agent["vllm"]["distribution"] == dist
    assert facts.known and audit.version == version
    assert audit.unconfirmed == []
    if exp is None:  # no hand-written row: every entry confirmed at its def line
        for ref in (audit.dispatch, audit.prefill_entry, audit.decode_entry, audit.metadata_split):
            assert ref is not None and ref.confirmed, ref
            assert ref.line == _def_line(tree / ref.file, ref.symbol) is not None, ref.symbol
        return
    _check_ref(tree, audit.dispatch, *exp["dispatch"])
    _check_ref(tree, audit.prefill_entry, *exp["prefill"])
    _check_ref(tree, audit.decode_entry, *exp["decode"])
    _check_ref(tree, audit.metadata_split, *exp["split"])
    assert audit.unconfirmed == []


@pytest.mark.parametrize("dist, version", RELEASES)
def test_backend_decode_entries(dist, version):
    tree, _, _, audit = _run(dist, version)
    got = {}
    for ref in audit.decode_entries:
        assert ref.confirmed, ref.note
        assert ref.line == _def_line(tree / ref.file, ref.symbol) is not None, (ref.backend, ref.symbol)
        got.setdefault(ref.backend, []).append((ref.symbol, ref.file[len("vllm/"):]))
    assert got
    if version in EXPECTED:
        assert got == EXPECTED[version]["backends"]


@pytest.mark.parametrize("dist, version", RELEASES)
def test_sparse_gate(dist, version):
    tree, _, facts, audit = _run(dist, version)
    if version not in EXPECTED:
        assert all(r.confirmed for r in audit.sparse_gate["refs"])
        return
    files = EXPECTED[version]["sparse"]
    gate = audit.sparse_gate
    if not files:
        assert gate["present"] is False and gate["refs"] == [] and facts.sparse_mode == "none"
        return
    assert gate["present"] is True and gate["kind"] == "config_hasattr"
    assert gate["routing"]
    by_file = {r.file: r for r in gate["refs"]}
    for f in files:
        ref = by_file["vllm/" + f]
        assert ref.confirmed
        text = (tree / ref.file).read_text(encoding="utf-8").splitlines()[ref.line - 1]
        assert re.search(r'is_v32 = (hasattr\(config, "index_topk"\)|True)', text), text
    assert all(r.confirmed for r in gate["refs"])


def _statement(lines, line: int) -> str:
    """The confirming line joined with its continuation lines up to the closing bracket: a call such as
    `_init_reorder_batch_threshold(` may give its value on the next line (flashinfer_mla_sparse.py 0.25.1)."""
    text, i = lines[line - 1], line
    while text.count("(") > text.count(")") and i < min(len(lines), line + 4):
        text, i = text + " " + lines[i].strip(), i + 1
    return text


@pytest.mark.parametrize("dist, version", RELEASES)
def test_decode_thresholds(dist, version):
    tree, _, _, audit = _run(dist, version)
    if version not in EXPECTED:
        assert all(ref.confirmed for ref in audit.threshold_refs.values()), audit.threshold_refs
        return
    for name, want in EXPECTED[version]["thresholds"].items():
        ref = audit.threshold_refs[name]
        assert ref.confirmed, ref.note
        text = _statement((tree / ref.file).read_text(encoding="utf-8").splitlines(), ref.line)
        if isinstance(want, int):
            assert audit.decode_thresholds[name] == want
            assert re.search(r"\b%d\b" % want, text) or (want == 1 and "num_tokens == 1" in text), text
        else:
            assert want in text and isinstance(audit.decode_thresholds[name], dict)
    if not EXPECTED[version]["thresholds"]:
        assert audit.decode_thresholds == {}


@pytest.mark.parametrize("dist, version", RELEASES)
def test_cudagraph_default_and_never_patch(dist, version):
    tree, _, _, audit = _run(dist, version)
    cg = audit.full_cudagraph_decode_default
    if version in EXPECTED:
        assert cg["mode"] == EXPECTED[version]["cudagraph"]
    if cg["ref"] is not None:
        assert cg["ref"].confirmed
    assert audit.never_patch
    for ref in audit.never_patch:
        assert ref.confirmed and ref.line == _def_line(tree / ref.file, ref.symbol), ref.symbol


def _string_templates(text: str):
    """Every string literal (implicit concatenation merged by the parser) and f-string as `{expr}` text."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else "{%s}" % ast.unparse(v.value)
                               for v in node.values))
    return out


@pytest.mark.parametrize("dist, version", RELEASES)
def test_log_formats_occur_in_sources(dist, version):
    tree, _, facts, _ = _run(dist, version)
    assert any(lf.kind == "decode_backend" for lf in facts.logs)
    for lf in facts.logs:
        path = tree / "vllm" / lf.file
        assert path.is_file(), (lf.id, lf.file)
        text = path.read_text(encoding="utf-8")
        assert lf.format in text or any(lf.format in s for s in _string_templates(text)), (lf.id, lf.file, lf.format)


@pytest.mark.parametrize("dist, version", RELEASES)
def test_server_settings_are_flags_each_release_accepts(dist, version):
    """The second pass's settings, as knowledge turns them into arguments, exist in each wheel's arg parser."""
    tree, _, _, _ = _run(dist, version)
    kb = load_knowledge()
    text = (tree / "vllm" / "engine" / "arg_utils.py").read_text(encoding="utf-8")
    for name in kb.server_setting_names():
        for value in ("on", "off"):
            for arg in kb.setting_args(version, name, value):
                flag = arg[len("--no-"):] if arg.startswith("--no-") else arg[2:]
                assert f'"--{flag}"' in text or f"'--{flag}'" in text, (version, arg)
                if arg.startswith("--no-"):  # only argparse's BooleanOptionalAction makes --no-X
                    assert "BooleanOptionalAction" in text, (version, arg)
