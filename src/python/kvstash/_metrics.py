"""A Store's own metrics (Store.metrics_text: Prometheus' text format) handed to an engine's
Prometheus registry, as vLLM's and SGLang's integrations do: the text parsed into series, the
increments since the last look (Deltas), and those increments recorded into prometheus_client
metrics of the engine's (Recorder), counters as counters and histograms as histograms with
the same buckets.

Series are keyed by their text ("name{a=\"x\"}"): plain strings, so that the increments cross
process boundaries (vLLM sends a worker's stats to its logger process) as a dict of numbers.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_series(series: str) -> tuple[str, list[tuple[str, str]]]:
    """'name{a="x",b="y"}' -> ('name', [('a', 'x'), ('b', 'y')])."""
    name, brace, rest = series.partition("{")
    if not brace:
        return name, []
    labels = [(k, re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], v)) for k, v in _LABEL.findall(rest)]
    return name, labels


def samples(text: str) -> dict[str, float]:
    """The series of a text exposition and their values (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        out[series] = float(value)
    return out


class Deltas:
    """What each series of a store's metrics grew by since the last call (counters, and a
    histogram's buckets, sum and count, only ever grow)."""

    def __init__(self, read: Callable[[], str]):
        self._read = read
        self._last: dict[str, float] = {}

    def take(self) -> dict[str, float]:
        now = samples(self._read())
        out = {k: v - self._last.get(k, 0.0) for k, v in now.items() if v != self._last.get(k, 0.0)}
        self._last = now
        return out


# The buckets of a store's latency histograms (src/common/metrics.h, kLatencyBuckets).
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
           2.5, 5.0, 10.0)


class Recorder:
    """Records increments (Deltas.take's, summed over workers) into prometheus_client metrics
    made with `counter_cls` and `histogram_cls` (the engine's own classes: vLLM hands its
    multiprocess-aware ones), named `prefix` + the store's name, with the engine's `labelnames`
    first and the store's labels after them.

    A histogram's increments are bucket counts, not observations: each is recorded as that many
    observations inside its bucket, placed so that their sum is the increment of the store's
    sum, so both the buckets and the sum come out as the store counted them."""

    def __init__(self, counter_cls: Any, histogram_cls: Any, labelnames: list[str], prefix: str = ""):
        self._counter_cls, self._histogram_cls = counter_cls, histogram_cls
        self._labelnames, self._prefix = list(labelnames), prefix
        self._metrics: dict[str, Any] = {}

    def _metric(self, cls: Any, name: str, labelnames: list[str], **kw: Any) -> Any:
        m = self._metrics.get(name)
        if m is None:
            m = cls(name=self._prefix + name, documentation=f"kvstash {name} (docs/operations.md, Engine-side metrics)",
                    labelnames=self._labelnames + labelnames, **kw)
            self._metrics[name] = m
        return m

    def record(self, deltas: dict[str, float], labelvalues: list[Any]) -> None:
        histograms: dict[tuple[str, tuple], dict[str, Any]] = {}
        for series, delta in deltas.items():
            name, labels = parse_series(series)
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix):
                    family = name[: -len(suffix)]
                    le = dict(labels).get("le")
                    key = (family, tuple((k, v) for k, v in labels if k != "le"))
                    h = histograms.setdefault(key, {"buckets": {}, "sum": 0.0})
                    if suffix == "_bucket" and le is not None:
                        h["buckets"][math.inf if le == "+Inf" else float(le)] = delta
                    elif suffix == "_sum":
                        h["sum"] = delta
                    break
            else:
                counter = self._metric(self._counter_cls, name.removesuffix("_total"), [k for k, _ in labels])
                counter.labels(*labelvalues, *[v for _, v in labels]).inc(delta)
        for (family, labels), h in histograms.items():
            metric = self._metric(self._histogram_cls, family, [k for k, _ in labels], buckets=BUCKETS)
            child = metric.labels(*labelvalues, *[v for _, v in labels])
            for value in _observations(h["buckets"], h["sum"]):
                child.observe(value)


def _observations(cumulative: dict[float, float], total: float) -> list[float]:
    """Values, one per observation, that fall in the buckets as `cumulative` (upper bound ->
    increment of its cumulative count) says and add up to `total` where the buckets allow it:
    every value at the same fraction of its bucket's width."""
    spans, below, lower = [], 0.0, 0.0
    for bound in sorted(cumulative):
        n = int(round(cumulative[bound] - below))
        below = cumulative[bound]
        upper = bound if math.isfinite(bound) else lower * 2 or 1.0
        if n > 0:
            spans.append((lower, upper, n))
        lower = bound if math.isfinite(bound) else lower
    lo = sum(a * n for a, _, n in spans)
    hi = sum(b * n for _, b, n in spans)
    t = 1.0 if hi <= lo else min(1.0, max(0.0, (total - lo) / (hi - lo)))
    return [a + t * (b - a) for a, b, n in spans for _ in range(n)]
