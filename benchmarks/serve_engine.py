"""One model's turn of benchmarks/serve.py, in vLLM's environment: its engine, N requests at once, its own stats.

    venv-vllm/bin/python benchmarks/serve_engine.py JOB.json EVENTS.jsonl

serve.py writes JOB (vLLM's engine arguments, the prompts as token ids, the concurrencies, the
sampling) and starts this script in vLLM's Python; this script appends JSON lines to EVENTS, which
serve.py reads while it runs: ``ready`` (the engine is up: its vLLM, the rnnify it imports, the
cache blocks it made, each a block of KV cache or one sequence's state), ``start`` (N requests are submitted),
``tokens`` (a step produced new output tokens), ``result`` (what the engine recorded for N).

The engine is vLLM's ``LLMEngine``, the one under ``vllm.LLM``: the same scheduler, continuous
batching, chunked prefill and cache as the OpenAI server's, without HTTP. All N requests are added
at once, then the engine steps until they finish. The latencies and counts are vLLM's own, from its
stat-logger interface (``StatLoggerBase.record``, called once per engine step): time to first token
from a request's arrival, inter-token latency between a request's successive tokens (engine-core
timestamps), requests running and waiting after each step, preemptions, and the share of the cache
in use (KV blocks, or state slots).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import vllm
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.loggers import StatLoggerBase


class Recorder(StatLoggerBase):
    """Keeps what the engine reports each step; ``latest`` is the one the engine made."""

    latest: Recorder | None = None

    def __init__(self, vllm_config, engine_index: int = 0):
        Recorder.latest = self
        self.reset()

    def reset(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.preemptions = self.max_running = self.max_waiting = 0
        self.max_cache_usage = 0.0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.max_running = max(self.max_running, scheduler_stats.num_running_reqs)
            waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.max_waiting = max(self.max_waiting, waiting)
            self.max_cache_usage = max(self.max_cache_usage, scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            self.ttft += iteration_stats.time_to_first_tokens_iter
            self.itl += iteration_stats.inter_token_latencies_iter
            self.preemptions += iteration_stats.num_preempted_reqs

    def log_engine_initialized(self) -> None:
        pass


def run(engine: LLMEngine, tag: str, prompts: list[list[int]], params: SamplingParams, emit) -> tuple[int, float]:
    """Adds every prompt at once and steps until all finish: (output tokens, seconds)."""
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    total = 0
    while engine.has_unfinished_requests():
        new = sum(len(out.outputs[0].token_ids) for out in engine.step())
        if new:
            total += new
            emit(event="tokens", count=new)
    return total, time.perf_counter() - started


def main(job_path: str, events_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    with open(events_path, "a", buffering=1) as events:

        def emit(**event) -> None:
            events.write(json.dumps(event) + "\n")

        started = time.perf_counter()
        engine = LLMEngine.from_engine_args(EngineArgs(**job["engine"]), stat_loggers=[Recorder])
        cache = engine.vllm_config.cache_config  # a block: block_size tokens of KV cache, or one state slot
        emit(
            event="ready",
            startup_s=time.perf_counter() - started,
            vllm=vllm.__version__,
            rnnify=str(Path(importlib.util.find_spec("rnnify").origin).parent),  # the plugin's code, as imported
            cache_blocks=cache.num_gpu_blocks,
            block_size=cache.block_size,
        )
        recorder = Recorder.latest

        def params(tokens: int) -> SamplingParams:
            return SamplingParams(
                max_tokens=tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )

        warmup = job["warmup_tokens"]
        run(engine, "warmup", [job["prompts"][0][:warmup]], params(warmup), lambda **event: None)
        for count in job["concurrency"]:
            emit(event="start", concurrency=count)
            recorder.reset()
            tokens, seconds = run(engine, f"n{count}", job["prompts"][:count], params(job["new_tokens"]), emit)
            emit(
                event="result",
                concurrency=count,
                output_tokens=tokens,
                duration_s=seconds,
                ttft_s=recorder.ttft,
                itl_s=recorder.itl,
                preemptions=recorder.preemptions,
                max_running=recorder.max_running,
                max_waiting=recorder.max_waiting,
                max_cache_usage=recorder.max_cache_usage,
            )
    return 0


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process, which re-imports this file
    raise SystemExit(main(*sys.argv[1:]))
