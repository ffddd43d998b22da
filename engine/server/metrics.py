"""Prometheus metrics with vLLM v1's names, types, buckets and labels (`model_name`, `engine`): dashboards and
alerts written for vLLM read them unchanged. Like vLLM, no `_created` series."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagekube.engine.core.sequence import Request

prometheus_client.disable_created_metrics()
ENGINE_INDEX = "0"  # vLLM v1's `engine` label: one engine core per server here

# Buckets as vLLM uses them, so existing dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts bounded by max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class EngineMetrics:
    """Implements the engine's StatListener; gauges are refreshed from engine state on every iteration."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, max_model_len: int = 100_000,
                 cache_config: dict | None = None, spec_stats=None, max_loras: int | None = None):
        self.registry = registry or CollectorRegistry()
        r, label, values = self.registry, ["model_name", "engine"], (model_name, ENGINE_INDEX)
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(name, doc, label, registry=r).labels(*values)

        def counter(name, doc):
            return Counter(name, doc, label, registry=r).labels(*values)

        def hist(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(*values)

        token_buckets = buckets_1_2_5(max_model_len)
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1")
        self.draining = gauge("pagekube:draining", "1 while the server drains after SIGTERM")
        self._kernels = Gauge("pagekube:kernels_info", "1, labelled with the kernels the model runs",
                              [*label, "device", "dtype", "attention", "cpu_kernels"], registry=r)
        self._label_values = values
        self.fragmentation = gauge("pagekube:kv_cache_fragmentation_ratio", "Allocated KV token slots / tokens held")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (recompute)")
        self.success = Counter("vllm:request_success", "Finished requests", [*label, "finished_reason"], registry=r)
        self.cache_queries = counter("vllm:prefix_cache_queries", "Prefix-cache lookups, in tokens")
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Decode time / (output tokens - 1), per request",
                         ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled (WAITING)", LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds", "First scheduled to finish (RUNNING)",
                                   LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "First scheduled to first token (PREFILL)",
                                 LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds", "First token to finish (DECODE)", LATENCY_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request", token_buckets)
        self.req_gen = hist("vllm:request_generation_tokens", "Generation tokens per request", token_buckets)
        self.req_max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens request parameter", token_buckets)
        self.req_n = hist("vllm:request_params_n", "The n request parameter", N_BUCKETS)
        self.iter_tokens = hist("vllm:iteration_tokens_total", "Tokens per engine step", TOKEN_BUCKETS)
        if cache_config is not None:  # vLLM's info gauge: the cache settings as labels, value 1
            info = {k: str(v) for k, v in cache_config.items()}
            Gauge("vllm:cache_config_info", "KV-cache configuration", [*label, *info], registry=r).labels(
                *values, *info.values()).set(1)
        for reason in ("stop", "length", "abort"):
            self.success.labels(*values, reason)
        self._cache_seen = (0, 0)
        self.spec_stats = spec_stats  # speculative decoding's counters (engine/spec_decode/speculative.py), when it is on
        if spec_stats is not None:  # as vLLM: these series exist only when speculation is configured
            self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Sequence-steps that carried draft tokens")
            self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed")
            self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position",
                              [*label, "position"], registry=r)
            self.spec_per_pos = [per_pos.labels(*values, str(i)) for i in range(len(spec_stats.accepted_per_pos))]
            self._spec_seen = (0, 0, 0, [0] * len(spec_stats.accepted_per_pos))

        self.lora = None if max_loras is None else LoRAMetrics(r, label, values, max_loras)

    # ---- StatListener ---------------------------------------------------------------------------------------
    def kernels_info(self, report: dict[str, str]) -> None:
        self._kernels.labels(*self._label_values, report["device"], report["dtype"], report["attention"],
                             report["cpu_kernels"]).set(1)

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
        if self.spec_stats is not None:
            self._refresh_spec()
        if self.lora is not None:
            self.lora.refresh(engine)

    def _refresh_spec(self) -> None:
        st, (drafts, tokens, accepted, per_pos) = self.spec_stats, self._spec_seen
        self.spec_drafts.inc(st.num_drafts - drafts)
        self.spec_draft_tokens.inc(st.num_draft_tokens - tokens)
        self.spec_accepted.inc(st.num_accepted_tokens - accepted)
        for counter, now, seen in zip(self.spec_per_pos, st.accepted_per_pos, per_pos, strict=True):
            counter.inc(now - seen)
        self._spec_seen = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos))

    # ---- the pooling runner (engine/pooling/async_pooling.py) ---------------------------------------------
    def on_pooling_iteration(self, engine, num_tokens: int) -> None:
        self.iter_tokens.observe(num_tokens)
        self.running.set(engine.running)

    def on_pooled_request(self, job) -> None:
        """An embeddings request ended: each input counts as a request, as vLLM counts pooling prompts."""
        end, start = job.finished_time, job.first_scheduled_time
        for prompt in job.prompts:
            self.prompt_tokens.inc(len(prompt))
            self.req_prompt.observe(len(prompt))
            self.e2e.observe(end - job.arrival_time)
            if start is not None:
                self.queue_time.observe(start - job.arrival_time)
                self.inference_time.observe(end - start)
            self.success.labels(self.model_name, ENGINE_INDEX, job.finish_reason).inc()

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
        if m.first_scheduled_time is not None:
            self.inference_time.observe(m.finished_time - m.first_scheduled_time)
        if m.first_token_time is not None:  # never set for a request aborted before its first token
            self.prefill_time.observe(m.first_token_time - (m.first_scheduled_time or m.arrival_time))
            self.decode_time.observe(m.finished_time - m.first_token_time)
            if len(m.token_gaps) > 0:
                self.tpot.observe((m.last_token_time - m.first_token_time) / len(m.token_gaps))
        self.req_prompt.observe(len(req.prompt_token_ids))
        self.req_gen.observe(sum(s.num_output_tokens for s in req.seqs))
        self.req_max_tokens.observe(req.max_tokens)
        self.req_n.observe(req.params.n)
        self.success.labels(self.model_name, ENGINE_INDEX, req.finish_reason or "abort").inc()


class LoRAMetrics:
    """vLLM's `vllm:lora_requests_info` (the adapters running and waiting, comma-joined, as labels; its value the
    time of the update), which the Gateway API Inference Extension's LoRA-affinity scorer reads, and
    `pagekube:lora_requests{adapter,state}`: requests per adapter, which a comma-joined label cannot count. vLLM keeps
    every label combination it ever set; here the previous one is removed, so the info gauge has one series.
    `pagekube:lora_adapter_loaded{adapter,error}`: 1 for each adapter served, 0 (with the reason) for each of
    --lora-modules that could not be; the operator reads it for status.adapters, and SREs can alert on 0."""

    def __init__(self, registry, label: list[str], values: tuple, max_loras: int):
        self.info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests",
                          ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry)
        self.requests = Gauge("pagekube:lora_requests", "Requests per LoRA adapter, running or waiting",
                              [*label, "adapter", "state"], registry=registry)
        self.loaded = Gauge("pagekube:lora_adapter_loaded", "1 for a LoRA adapter served, 0 for one that could not "
                            "be loaded (the reason in `error`)", [*label, "adapter", "error"], registry=registry)
        self.max_lora, self.values = str(max_loras), values
        self._info_labels: tuple | None = None
        self._series: set[tuple[str, str]] = set()
        self._loaded: set[tuple[str, str]] = set()

    def refresh_loaded(self, manager) -> None:
        """The loaded gauge from the LoRAManager alone (its own lock guards it). The /metrics route calls it on
        each scrape, so a server that has run no step yet reports its adapters, and no step pays for it."""
        loaded = set(manager.states().items())
        for gone in self._loaded - loaded:
            self.loaded.remove(*self.values, *gone)
        for adapter, error in loaded:
            self.loaded.labels(*self.values, adapter, error).set(0 if error else 1)
        self._loaded = loaded

    def refresh(self, engine) -> None:
        counts: dict[tuple[str, str], set[str]] = {}
        for state, seqs in (("running", engine.scheduler.running), ("waiting", engine.scheduler.waiting)):
            for seq in seqs:
                if seq.request.lora is not None:
                    counts.setdefault((seq.request.lora.name, state), set()).add(seq.request.request_id)
        names = {a.lora_name for a in engine.lora.names()} if engine.lora is not None else set()
        series = {(n, st) for n in names for st in ("running", "waiting")} | set(counts)
        for gone in self._series - series:
            self.requests.remove(*self.values, *gone)
        for key in series:
            self.requests.labels(*self.values, *key).set(len(counts.get(key, ())))
        self._series = series
        labels = (self.max_lora, ",".join(sorted(n for n, st in counts if st == "waiting")),
                  ",".join(sorted(n for n, st in counts if st == "running")))
        if self._info_labels not in (None, labels):
            self.info.remove(*self._info_labels)
        self._info_labels = labels
        self.info.labels(*labels).set_to_current_time()
