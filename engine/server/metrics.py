"""Prometheus metrics with vLLM v1's names, types and `model_name` label (dashboards and alerts depend on them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagekube.engine.sequence import Request

# Buckets as vLLM uses them, so existing dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineMetrics:
    """Implements the engine's StatListener; gauges are refreshed from engine state on every iteration."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self.model_name = model_name

        def counter(name, doc, labels=label):
            return Counter(name, doc, labels, registry=r)

        def hist(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", label, registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", label, registry=r).labels(model_name)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1", label, registry=r).labels(model_name)
        self.draining = Gauge("pagekube:draining", "1 while the server drains after SIGTERM", label, registry=r).labels(model_name)
        self.fragmentation = Gauge("pagekube:kv_cache_fragmentation_ratio",
                                   "Allocated KV token slots / tokens held", label, registry=r).labels(model_name)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed").labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced").labels(model_name)
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (recompute)").labels(model_name)
        self.success = counter("vllm:request_success", "Finished requests", ["model_name", "finished_reason"])
        self.cache_queries = counter("vllm:prefix_cache_queries", "Prefix-cache lookups, in tokens").labels(model_name)
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens").labels(model_name)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.req_gen = hist("vllm:request_generation_tokens", "Generation tokens per request", TOKEN_BUCKETS)
        self.iter_tokens = hist("vllm:iteration_tokens_total", "Tokens per engine step", TOKEN_BUCKETS)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        self._cache_seen = (0, 0)

    # ---- StatListener ---------------------------------------------------------------------------------------
    def on_iteration(self, engine, num_tokens: int, num_generated: int, num_preemptions: int) -> None:
        self.iter_tokens.observe(num_tokens)
        self.generation_tokens.inc(num_generated)
        if num_preemptions:
            self.preemptions.inc(num_preemptions)
        self.refresh(engine)

    def refresh(self, engine) -> None:
        self.running.set(len({s.request.request_id for s in engine.scheduler.running}))
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.block_manager.usage)
        self.fragmentation.set(engine.kv_fragmentation())
        bm = engine.block_manager
        q, h = bm.prefix_cache_queries, bm.prefix_cache_hits
        self.cache_queries.inc(q - self._cache_seen[0])
        self.cache_hits.inc(h - self._cache_seen[1])
        self._cache_seen = (q, h)

    def on_first_token(self, req: Request) -> None:
        m = req.metrics
        self.prompt_tokens.inc(len(req.prompt_token_ids))
        self.ttft.observe(m.first_token_time - m.arrival_time)
        self.queue_time.observe((m.first_scheduled_time or m.first_token_time) - m.arrival_time)

    def on_request_finished(self, req: Request) -> None:
        m = req.metrics
        for gap in m.token_gaps:
            self.itl.observe(gap)
        self.e2e.observe(m.finished_time - m.arrival_time)
        self.req_prompt.observe(len(req.prompt_token_ids))
        self.req_gen.observe(sum(s.num_output_tokens for s in req.seqs))
        self.success.labels(self.model_name, req.finish_reason or "abort").inc()
