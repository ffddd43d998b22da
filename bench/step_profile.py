"""Host time per engine step, by phase, with the model's forward stubbed out: what a GPU step would pay around its
kernels at batch 1, 32 and 256 (scheduling, input preparation, sampling, detokenization, output processing and
metrics). The forward returns random logits of the model's vocabulary, so sampling costs what it really costs.

    .venv/bin/python bench/step_profile.py            # the bundled model's tokenizer and vocabulary
    .venv/bin/python bench/step_profile.py --smoke    # tiny sizes (the test suite runs this)
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict

import torch

from pagekube.engine import output_processor as engine_module
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import LLMEngine
from pagekube.engine.sampling_params import RequestOutputKind, SamplingParams
from pagekube.engine.server.metrics import EngineMetrics

PHASES = ["schedule", "inputs", "sampling", "detokenize", "output+metrics"]


class Timers:
    def __init__(self):
        self.total = defaultdict(float)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[phase] += time.perf_counter() - t
        return timed


def profile(engine: LLMEngine, batch: int, steps: int, prompt_len: int) -> dict[str, float]:
    """Microseconds per decode step, by phase, at `batch` running sequences."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", [100 + (i + j) % 4000 for j in range(prompt_len)], params)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()  # prefill: not what this measures
    assert len(engine.scheduler.running) == batch, "the KV pool is too small for this batch"
    timers = Timers()
    real = (engine.scheduler.schedule, engine.runner.execute, engine.sampler.__call__,
            engine_module.detokenize_incrementally)
    engine.scheduler.schedule = timers.wrap("schedule", real[0])
    engine.runner.execute = timers.wrap("inputs", real[1])
    sampler = engine.sampler
    engine.sampler = type("TimedSampler", (), {"__call__": staticmethod(timers.wrap("sampling", sampler.__call__)),
                                               "__getattr__": lambda self, n: getattr(sampler, n)})()
    engine_module.detokenize_incrementally = timers.wrap("detokenize", real[3])
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    engine.scheduler.schedule, engine.runner.execute, engine.sampler = real[0], real[1], sampler
    engine_module.detokenize_incrementally = real[3]
    for rid in list(engine.requests):
        engine.abort_request(rid)
    us = {p: timers.total[p] / steps * 1e6 for p in PHASES[:-1]}
    us["output+metrics"] = total / steps * 1e6 - sum(us.values())
    us["total"] = total / steps * 1e6
    return us


def stub_forward(engine: LLMEngine) -> None:
    """The forward becomes a table lookup of random logits: only host work is left in a step."""
    vocab = engine.hf_config.vocab_size
    logits = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0))

    def run(header, payload):
        return logits[: header[4]]
    engine.runner._run = run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    batches, steps = ([1, 4], 3) if args.smoke else ([1, 32, 256], args.steps)
    engine = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=256, kv_cache_memory=1024**3))
    stub_forward(engine)
    engine.stat_listeners.append(EngineMetrics("bench", max_model_len=engine.max_model_len,
                                               cache_config=engine.cache_config()))
    gc.collect()
    gc.freeze()  # as the server does after loading (engine/server/serve.py)
    print("| batch | " + " | ".join(PHASES) + " | total | per sequence |")
    print("|---:|" + "---:|" * (len(PHASES) + 2))
    for b in batches:
        us = profile(engine, b, steps, prompt_len=48)
        cells = " | ".join(f"{us[p]:.0f}" for p in PHASES)
        print(f"| {b} | {cells} | {us['total']:.0f} | {us['total'] / b:.1f} |", flush=True)
    print("(microseconds per decode step, host only: the forward is stubbed)")


if __name__ == "__main__":
    main()
