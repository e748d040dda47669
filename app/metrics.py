"""`GET /metrics` of `nanochat serve`: Prometheus' text exposition format, written here (a few counters,
gauges and two histograms do not need prometheus_client and its process-global registry).

Token counts and latencies are the server's own, measured where a client sees them (TTFT from the
request's arrival to its first token event; inter-token latency between a sequence's token events,
spread over the tokens each one carries, as the engine sends steps in batches). The KV cache, prefix
cache and scheduler figures are the engine's, from the stats it pushes to the client.
"""

from __future__ import annotations

import math
from bisect import bisect_left

from nanochat.engine.output import EngineStats

# vLLM's buckets, so dashboards built for it read these as well
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += times
        self.sum += value * times

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            total += count
            out.append(f'{name}_bucket{{le="{"+Inf" if bound == math.inf else bound}"}} {total}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {total}"]


class Metrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.requests = {}                       # finish reason -> requests (sequences) that ended so
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def finished(self, reason: str, stats=None) -> None:
        """A sequence ended; `stats`: the engine's RequestStats (a refused prompt's tokens do not count)."""
        self.requests[reason] = self.requests.get(reason, 0) + 1
        if stats is not None and reason in ("stop", "length", "abort"):
            self.prompt_tokens += stats.prompt_tokens
            self.cached_tokens += stats.cached_tokens
            self.completion_tokens += stats.completion_tokens

    def render(self, engine: EngineStats, in_flight: int, restarts: int) -> str:
        metrics = [
            ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [self.prompt_tokens]),
            ("prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.",
             [self.cached_tokens]),
            ("generation_tokens_total", "counter", "Generated tokens of finished requests.", [self.completion_tokens]),
            ("requests_finished_total", "counter", "Sequences that ended, by finish reason.",
             [(f'{{finished_reason="{r}"}}', n) for r, n in sorted(self.requests.items())]),
            ("time_to_first_token_seconds", "histogram", "Seconds from a request's arrival to its first token.",
             self.ttft),
            ("inter_token_latency_seconds", "histogram", "Seconds between a sequence's successive tokens.",
             self.itl),
            ("requests_in_flight", "gauge", "Sequences the server has taken and not finished (--max-queue counts "
                                            "these).", [in_flight]),
            ("num_requests_running", "gauge", "Sequences the engine runs in its batch.", [engine.running]),
            ("num_requests_waiting", "gauge", "Sequences waiting for the engine.", [engine.waiting]),
            ("kv_cache_blocks_used", "gauge", "KV-cache blocks in use (running sequences and kept conversations).",
             [engine.kv_blocks_used]),
            ("kv_cache_blocks_total", "gauge", "KV-cache blocks in all.", [engine.kv_blocks_total]),
            ("prefix_cache_hit_rate", "gauge", "Share of queried prompt tokens found in the prefix cache.",
             [engine.prefix_hit_rate]),
            ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache (this engine "
                                                      "process).", [engine.prefix_queried_tokens]),
            ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (this engine process).",
             [engine.prefix_hit_tokens]),
            ("engine_restarts_total", "counter", "Engine processes started again after one died.", [restarts]),
        ]
        lines = []
        for name, kind, text, value in metrics:
            name = f"nanochat_{name}"
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            if isinstance(value, Histogram):
                lines += value.lines(name)
            else:
                lines += [f"{name}{v[0]} {v[1]}" if isinstance(v, tuple) else f"{name} {v}" for v in value]
        return "\n".join(lines) + "\n"
