"""The server's Prometheus metrics: request outcomes, tokens, latency histograms, and gauges read from the
engine thread's latest `EngineStats` snapshot (never from the scheduler itself)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shardforge.infer.runner import EngineRunner, Timing


class Metrics:
    def __init__(self, runner: EngineRunner) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("shardforge_requests", "Requests by outcome", ["status"], registry=registry)
        self.prompt_tokens = Counter("shardforge_prompt_tokens", "Prompt tokens taken", registry=registry)
        self.output_tokens = Counter("shardforge_generation_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram(
            "shardforge_time_to_first_token_seconds",
            "Time from arrival to the first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.tpot = Histogram(
            "shardforge_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        self.itl = Histogram(
            "shardforge_inter_token_latency_seconds",
            "Time between two successive pieces of one completion",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )

        def hit_rate() -> float:
            stats = runner.stats
            return stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0

        def acceptance() -> float:
            stats = runner.stats
            return stats.spec_accepted_tokens / stats.spec_draft_tokens if stats.spec_draft_tokens else 0.0

        for name, doc, read in (
            ("shardforge_queue_length", "Requests waiting for their first token", lambda: runner.waiting),
            ("shardforge_running", "Sequences running", lambda: runner.stats.running),
            (
                "shardforge_waiting_sequences",
                "Sequences the scheduler holds back",
                lambda: runner.stats.waiting,
            ),
            ("shardforge_kv_blocks_in_use", "KV cache blocks in use", lambda: runner.stats.blocks_used),
            ("shardforge_kv_blocks_total", "KV cache blocks", lambda: runner.stats.blocks_total),
            (
                "shardforge_prefix_cache_queried_tokens",
                "Prompt tokens looked up",
                lambda: runner.stats.prefix_queries,
            ),
            (
                "shardforge_prefix_cache_hit_tokens",
                "Prompt tokens found cached",
                lambda: runner.stats.prefix_hits,
            ),
            ("shardforge_prefix_cache_hit_rate", "Cached share of the tokens looked up", hit_rate),
            ("shardforge_preemptions", "Sequences preempted so far", lambda: runner.stats.preemptions),
            (
                "shardforge_spec_decode_num_drafts",
                "Speculative steps of a sequence so far (one verification of its draft each)",
                lambda: runner.stats.spec_drafts,
            ),
            (
                "shardforge_spec_decode_num_draft_tokens",
                "Draft tokens the model checked so far",
                lambda: runner.stats.spec_draft_tokens,
            ),
            (
                "shardforge_spec_decode_num_accepted_tokens",
                "Draft tokens kept so far",
                lambda: runner.stats.spec_accepted_tokens,
            ),
            ("shardforge_spec_decode_acceptance_rate", "Kept share of the draft tokens", acceptance),
        ):
            Gauge(name, doc, registry=registry).set_function(read)

    def finished(self, timing: Timing) -> None:
        self.requests.labels(timing.reason).inc()
        self.output_tokens.inc(timing.tokens)
        for gap in timing.gaps:
            self.itl.observe(gap)
        if timing.first is not None:
            self.ttft.observe(timing.first - timing.arrived)
            if timing.tokens > 1 and timing.last is not None:
                self.tpot.observe((timing.last - timing.first) / (timing.tokens - 1))
