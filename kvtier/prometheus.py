"""kvtier's Prometheus metrics (prometheus-client, the `metrics` extra; optional).

One naming scheme, derived from the stats every part already keeps: a stats key `name` becomes
`kvtier_name`, a key `tier.name` becomes `kvtier_tier_name{tier="tier"}`, and an SGLang adapter
key `sglang.name` becomes `kvtier_sglang_name`. Keys in `GAUGES` (sizes, queue depths, states)
are gauges, every other key counts events and is a counter (`_total`). Tier calls are timed in
`kvtier_tier_op_seconds{tier, op}` histograms, kvtier's calls on SGLang's scheduler thread in
`kvtier_scheduler_seconds{call}`.

The values are live prometheus-client objects, refreshed from the sources' `stats()` once a
second by a background thread and at every scrape of kvtier's own endpoint. Live objects are
what SGLang's `/metrics` can show: with `--enable-metrics` SGLang runs prometheus-client in
multiprocess mode, where values travel between processes through files and custom collectors
are never asked. kvtier's own endpoint (`metrics_port`) serves this process's values, or all
processes' values in multiprocess mode, on loopback only (`METRICS_ADDR`): the series name
models, tenants' namespaces and traffic, and the endpoint has no authentication. To scrape from
elsewhere, put a sidecar or a port-forward in front of it (docs/metrics.md).

Tenants (a request's `cache_salt`) are many and unbounded, so no series is labelled with one:
the CPU tier's bytes per tenant (the counts `tenant_max_fraction` keeps) are summed into
`TENANT_BUCKETS` buckets by the first hex digit of each tenant's keyed tag
(`kvtier.keys.tenant_tag`, the one its records' key names carry), plus `none` for unsalted
chunks: `kvtier_tenant_bytes{tier, tenant_bucket}`, 17 series per tier whatever the traffic,
every bucket always set (an emptied one reads 0: prometheus-client cannot remove a series in
SGLang's multiprocess mode, so a label set that followed the tenants would only grow). Beside
them, `kvtier_tenants{tier}` and `kvtier_tenant_max_bytes{tier}`: how many tenants hold chunks
and the most one holds. Neither the salt nor the tag is a label value.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvtier.background import name_os_thread

__all__ = ["register", "observe", "observe_scheduler", "serve", "serve_rank", "sync", "GAUGES",
           "available"]

logger = logging.getLogger(__name__)

GAUGES = frozenset({
    "entries", "bytes", "capacity_bytes", "pinned_bytes", "write_queue", "down",
    "arena_used_bytes", "arena_bytes", "prefetch_queue", "sessions_pinned",
    "session_pinned_bytes", "session_pinned_cap_bytes", "est_latency_seconds",
    "est_read_bytes_per_second", "est_prefill_tokens_per_second", "est_measured",
    "est_prefill_measured", "retained_prefixes",
})
_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
SYNC_INTERVAL_S = 1.0
# Tenant buckets: the first hex digit of a tenant's keyed tag (uniform: an HMAC), and `none`.
TENANT_BUCKETS = (*"0123456789abcdef", "none")
_KEPT_TAGS = 65536  # salt -> bucket, per source; cleared past this (an HMAC each to refill)
# The one address kvtier's endpoint binds (issue 36, item 7: it bound every interface).
METRICS_ADDR = "127.0.0.1"


class _Exporter:
    """The process's metric objects and the sources they are refreshed from."""

    def __init__(self) -> None:
        import prometheus_client as pc

        self._pc = pc
        self._lock = threading.Lock()
        self._sources: list[weakref.ref[Any]] = []
        self._metrics: dict[str, Any] = {}
        # (source, metric, tier) -> the counter's value at the last sync
        self._last: dict[tuple[int, str, str], float] = {}
        self.op_seconds = pc.Histogram("kvtier_tier_op_seconds", "Duration of kvtier tier calls",
                                       ["tier", "op"], buckets=_BUCKETS)
        self.scheduler_seconds = pc.Histogram(
            "kvtier_scheduler_seconds", "Duration of kvtier calls on the serving engine's "
            "scheduler thread", ["call"], buckets=_BUCKETS)
        self.hit_seconds = pc.Histogram(
            "kvtier_hit_seconds", "Duration of the pieces of serving a kvtier hit: lookup "
            "(match), gate (waiting for the prefetch), copy (into the KV pool), insert (into "
            "the radix tree)", ["piece"], buckets=_BUCKETS)
        self.tenant_bytes = pc.Gauge(
            "kvtier_tenant_bytes", "Bytes of the tier's chunks held by the tenants in each "
            "bucket (first hex digit of the tenant's keyed tag; none: unsalted)",
            ["tier", "tenant_bucket"], multiprocess_mode="livesum")
        self.tenants = pc.Gauge("kvtier_tenants", "Tenants holding chunks in the tier",
                                ["tier"], multiprocess_mode="livesum")
        self.tenant_max = pc.Gauge("kvtier_tenant_max_bytes", "Bytes held by the tenant that "
                                   "holds the most of the tier", ["tier"],
                                   multiprocess_mode="livesum")
        # source -> salt -> bucket
        self._buckets: weakref.WeakKeyDictionary[Any, dict[str, str]] = \
            weakref.WeakKeyDictionary()
        self._served: set[int] = set()
        # (histogram, label values) -> its child: `labels()` validates and locks on every call,
        # a cost every tier call on a serving thread would pay again.
        self._children: dict[tuple[Any, ...], Any] = {}
        threading.Thread(target=self._run, name="kvtier-metrics", daemon=True).start()

    def time(self, histogram: Any, *labels: str) -> Any:
        """`histogram.labels(*labels)`, made once per label values."""
        key = (histogram, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = histogram.labels(*labels)
        return child

    def add(self, source: Any) -> None:
        with self._lock:
            self._sources.append(weakref.ref(source))

    def sync(self) -> None:
        """Refresh every metric from its source's `stats()`."""
        with self._lock:
            live = [s for ref in self._sources if (s := ref()) is not None]
            self._sources = [weakref.ref(s) for s in live]
            for source in live:
                try:
                    stats = source.stats()
                except Exception as exc:  # a closed source: its last values stay
                    logger.debug("kvtier metrics: stats() failed: %r", exc)
                    continue
                self._update(id(source), stats)
                try:
                    self._update_tenants(source)
                except Exception as exc:  # a key file gone since: the last values stay
                    logger.debug("kvtier metrics: tenant bytes failed: %r", exc)

    def _update_tenants(self, source: Any) -> None:
        """The tenant gauges of `source`'s CPU tier, when it counts bytes per tenant (a
        storage manager whose CPU tier keeps a share: `tenant_max_fraction` < 1)."""
        counts = _tenant_counts(source)
        if not counts:
            return
        tier, held = counts
        buckets = self._buckets.setdefault(source, {})
        if len(buckets) > _KEPT_TAGS:
            buckets.clear()
        sums = dict.fromkeys(TENANT_BUCKETS, 0)
        for salt, nbytes in held.items():
            bucket = buckets.get(salt)
            if bucket is None:
                bucket = buckets[salt] = _bucket_of(source, salt)
            sums[bucket] += nbytes
        for bucket, nbytes in sums.items():
            self.time(self.tenant_bytes, tier, bucket).set(nbytes)
        self.time(self.tenants, tier).set(len(held))
        self.time(self.tenant_max, tier).set(max(held.values(), default=0))

    def _update(self, source: int, stats: Mapping[str, float]) -> None:
        for key, value in stats.items():
            tier, dot, name = key.rpartition(".")
            if tier == "sglang":
                tier, name = "", f"sglang_{name}"
            metric = self._metric(name, labelled=bool(tier))
            if metric is None:
                continue
            target = metric.labels(tier=tier) if tier else metric
            if name in GAUGES:
                target.set(value)
                continue
            last = self._last.get((source, name, tier), 0.0)
            if value > last:
                target.inc(value - last)
            self._last[(source, name, tier)] = max(value, last)

    def _metric(self, name: str, labelled: bool) -> Any:
        metric = self._metrics.get(name)
        if metric is not None and bool(metric._labelnames) != labelled:
            return None  # the same name with and without a tier: keep the first
        if metric is None:
            labels = ["tier"] if labelled else []
            doc = f"kvtier {name.replace('_', ' ')}"
            if name in GAUGES:
                metric = self._pc.Gauge(f"kvtier_{name}", doc, labels,
                                        multiprocess_mode="livesum")
            else:
                metric = self._pc.Counter(f"kvtier_{name}", doc, labels)
            self._metrics[name] = metric
        return metric

    def serve(self, port: int) -> None:
        """Serve `/metrics` on `METRICS_ADDR`:`port` (loopback), once per port and process."""
        with self._lock:
            if port in self._served:
                return
            self._served.add(port)
        pc = self._pc
        registry = pc.REGISTRY
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            from prometheus_client import multiprocess

            registry = pc.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = pc.CollectorRegistry(auto_describe=False)
            registry.register(_SyncThenCollect(self.sync, pc.REGISTRY))
        pc.start_http_server(port, addr=METRICS_ADDR, registry=registry)
        logger.info("kvtier: Prometheus metrics on %s:%d (/metrics; loopback only)",
                    METRICS_ADDR, port)

    def _run(self) -> None:
        name_os_thread()
        while True:
            time.sleep(SYNC_INTERVAL_S)
            self.sync()


def _tenant_counts(source: Any) -> tuple[str, dict[str, int]] | None:
    """(tier name, bytes per salt) of a storage manager's CPU tier (behind its guard); None
    for any other source, and while the tier counts no tenants (the share is off)."""
    hot = getattr(source, "hot", None)
    read = getattr(getattr(hot, "inner", hot), "tenant_bytes", None)
    if read is None:
        return None
    held = read()
    return (str(getattr(hot, "name", "")), held) if held else None


def _bucket_of(source: Any, salt: str) -> str:
    """A salt's bucket: `none` unsalted, else the first hex digit of its keyed tag under the
    source's key names (its config's `hash_salt` and `record_key_file`)."""
    if not salt:
        return "none"
    from kvtier.keys import tenant_tag

    return tenant_tag(_names_secret(source), salt)[0]


_SECRETS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _names_secret(source: Any) -> str:
    """The source's key-name secret (`sealing.name_salt`: reads the key file once)."""
    secret = _SECRETS.get(source)
    if secret is None:
        from kvtier.keys.record_keys import name_salt

        config = source.config
        secret = _SECRETS[source] = name_salt(config.hash_salt, config.record_key_file)
    return secret


class _SyncThenCollect:
    """Refreshes the live metrics, then yields everything in `registry`: a scrape sees the
    values of this moment, including metrics the refresh just created."""

    def __init__(self, sync: Callable[[], None], registry: Any):
        self._sync = sync
        self._registry = registry

    def describe(self) -> list[Any]:
        return []  # registering must not run a refresh (it would register under a lock)

    def collect(self) -> Iterator[Any]:
        self._sync()
        yield from self._registry.collect()


_exporter: _Exporter | None = None
_init_lock = threading.Lock()
_missing = False


def _get() -> _Exporter | None:
    global _exporter, _missing
    if _exporter is None and not _missing:
        with _init_lock:
            if _exporter is None and not _missing:
                try:
                    _exporter = _Exporter()
                except ImportError:
                    _missing = True
                    logger.info("kvtier: prometheus-client is not installed: no Prometheus "
                                "metrics (pip install 'kvtier[metrics]')")
    return _exporter


def available() -> bool:
    return _get() is not None


def register(source: Any) -> None:
    """Export `source.stats()` (held weakly: a closed source stops being read)."""
    exporter = _get()
    if exporter is not None:
        exporter.add(source)


def observe(tier: str, op: str, seconds: float) -> None:
    """Record the duration of one tier call."""
    if _exporter is not None:
        _exporter.time(_exporter.op_seconds, tier, op).observe(seconds)


def observe_scheduler(call: str, seconds: float) -> None:
    """Record the duration of one kvtier call on the serving engine's scheduler thread."""
    if _exporter is not None:
        _exporter.time(_exporter.scheduler_seconds, call).observe(seconds)


def observe_hit(piece: str, seconds: float) -> None:
    """Record the duration of one piece of serving a hit (`kvtier_hit_seconds`)."""
    if _exporter is not None:
        _exporter.time(_exporter.hit_seconds, piece).observe(seconds)


def serve(port: int) -> bool:
    """Serve `/metrics` on `port` of loopback (`METRICS_ADDR`); False when prometheus-client
    is not installed.

    Raises:
        OSError: the port cannot be bound.
    """
    exporter = _get()
    if exporter is None:
        return False
    exporter.serve(port)
    return True


def sync() -> None:
    """Refresh the metrics now (tests; the background thread does it every second)."""
    if _exporter is not None:
        _exporter.sync()


def serve_rank(port: int) -> None:
    """`serve(port)` for a TP rank (`metrics_port` + rank): every failure is a warning, never
    an error (no metrics endpoint must not take serving down)."""
    if port > 65535:  # the launcher refuses this; a direct caller may not
        logger.warning("kvtier: metrics_port + rank = %d is past 65535; no metrics endpoint on "
                       "this rank (lower metrics_port)", port)
        return
    try:
        if not serve(port):
            logger.warning("kvtier: metrics_port is set but prometheus-client is not installed "
                           "(pip install 'kvtier[metrics]'); no metrics endpoint")
    except OSError as exc:  # a busy port
        logger.warning("kvtier: cannot serve metrics on port %d: %s", port, exc)
