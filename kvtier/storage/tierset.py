"""The live set of lower tiers and their writers, built, changed and retired while stores and
loads run: the storage manager's tier management (`StorageManager.attach_tier` and friends
delegate here), plus what concerns every writer at once (flush, queue stats).

Readers take the current lists (`tiers`, `writers`) without locking: a change publishes new
lists and never mutates old ones, so a call that started on the old set finishes on it (the
tier's guard counts such calls, so a detached tier is closed only after they end). Changes
(attach, detach, close) take the set's lock, so none of them loses another's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvtier.backends import BackendContext, create_backend
from kvtier.config import Config
from kvtier.config.names import CPU
from kvtier.config.tiers import tier_names
from kvtier.metrics import RateLimitedLog
from kvtier.storage.guard import MIN_SAMPLE_BYTES, GuardedTier
from kvtier.storage.watch import TierWatch
from kvtier.storage.writer import TierWriter

__all__ = ["TierSet", "retire", "discard", "probe_tiers", "PROBE_BOUND_S"]

logger = logging.getLogger(__name__)

PROBE_MAX_BYTES = 4 << 20  # a probe's scratch record at most: a bandwidth sample, and short
# enough on a slow link (2 s at 2 MB/s)
# A server waits this long at most for its tiers' probes before it serves; a tier not measured
# by then has its hits loaded in the background until a read has timed it.
PROBE_BOUND_S = 3.0


class TierSet:
    """The lower tiers of one storage manager.

    Args:
        ctx: how tiers are built (the manager's config, layout, arena and counters).
        warn: the manager's rate-limited log.
        reachable: whether a chunk key is still in the hot tier (for write-back writers).
        watch: told what each tier's writer wrote.
    """

    def __init__(self, ctx: BackendContext, warn: RateLimitedLog,
                 reachable: Callable[[str], bool], watch: TierWatch | None = None) -> None:
        self.tiers: list[GuardedTier] = []
        self.writers: list[TierWriter] = []
        self._ctx = ctx
        self._warn = warn
        self._reachable = reachable
        self._watch = watch or TierWatch()
        self._lock = threading.Lock()
        self._closed = False

    def open(self, names: Iterable[str]) -> None:
        """Build each lower tier of `names` (the CPU tier is skipped), probe them all at once
        (`probe_tiers`: a few seconds at most), and add them; if one cannot be built, close
        every tier built so far and raise."""
        built: list[tuple[GuardedTier, TierWriter]] = []
        try:
            for name in names:
                if name != CPU:
                    built.append(self.build(name, probe=False))
        except BaseException:
            for tier, writer in built:  # nothing queued: the writer threads just end
                writer.close(self._ctx.config.blocking_timeout_secs)
                tier.close()
            raise
        probe_tiers([tier for tier, _ in built], self._probe_bytes())
        for pair in built:
            self.add(*pair)
        _warn_plain_records(self._ctx.config, [tier.name for tier, _ in built])

    def attach(self, name: str, config: Config | None = None) -> None:
        """Add lower tier `name` while stores and loads run (`build`, then `publish`); it
        serves hits at once.

        Args:
            name: `disk` or `redis`.
            config: the config to build it from (its `local_disk`/`remote_url` keys); default
                the manager's own.

        Raises:
            ValueError: `name` is `cpu` or already attached, or the set is closed.
            ConfigError: the tier cannot be built from `config` (e.g. no `remote_url`).
        """
        self.publish(*self.build(name, config))

    def build(self, name: str, config: Config | None = None, *, probe: bool = True,
              ) -> tuple[GuardedTier, TierWriter]:
        """The slow half of `attach`: build lower tier `name` (connect, index) from `config`
        (default the manager's), behind the failure guard, probe it (`probe_tiers`), and its
        writer; unpublished. Hand them to `publish`, or `discard` them. `ValueError` if
        `name` is the CPU tier or attached (checked before the build), `ConfigError` if it
        cannot be built."""
        if name == CPU or self.find(name) is not None:
            raise ValueError(f"tier {name!r} cannot be attached: it is the CPU tier or "
                             f"already attached ({[t.name for t in self.tiers]})")
        ctx = self._ctx
        if config is not None:
            ctx = BackendContext(config, ctx.layout, ctx.allocator, ctx.counters)
        backend = create_backend(name, ctx)
        backend.watch_evictions(self._watch)
        tier = GuardedTier(backend, ctx.counters, self._warn)
        if probe:  # timed before it is published: its first request plans on measured speeds
            probe_tiers([tier], self._probe_bytes())
        ctx.counters.declare(f"{tier.name}.hit_chunks")
        writer = TierWriter(tier, ctx.config.write_queue_chunks, ctx.counters, self._warn,
                            reachable=self._reachable, watch=self._watch)
        return tier, writer

    def _probe_bytes(self) -> int:
        """A probe's scratch record: one chunk, within `MIN_SAMPLE_BYTES`..`PROBE_MAX_BYTES`
        (a bandwidth sample, and a bounded cost on a slow link)."""
        chunk = self._ctx.layout.nbytes(self._ctx.config.chunk_size)
        return min(PROBE_MAX_BYTES, max(MIN_SAMPLE_BYTES, chunk))

    def publish(self, tier: GuardedTier, writer: TierWriter) -> None:
        """The fast half of `attach`: `add`, counted and logged, so the next call uses `tier`.
        On `ValueError` (attached meanwhile, or closed) the tier is discarded."""
        try:
            self.add(tier, writer)
        except ValueError:
            discard(tier, writer)
            raise
        self._ctx.counters.inc("tier_attached")
        logger.info("kvtier: attached tier %s; lower tiers now %s", tier.name,
                    [t.name for t in self.tiers])

    def detach(self, name: str, *, drain: bool = True, timeout: float | None = None,
               wait: bool = True) -> None:
        """Remove lower tier `name` while stores and loads run, then close it.

        New calls stop using it at once (`remove`); then it is retired (`retire`): its queued
        writes are written (`drain`, bounded by `timeout`, default `blocking_timeout_secs`) or
        dropped and counted; calls still running on it get up to `timeout` to finish (a call
        cut off by the close is a counted miss). Without `wait`, that draining and closing
        happens on a background thread.

        Raises:
            ValueError: `name` is `cpu` or not attached.
        """
        if name == CPU:
            raise ValueError("the CPU tier cannot be detached")
        timeout = self._ctx.config.blocking_timeout_secs if timeout is None else timeout
        tier, writer = self.remove(name)
        if wait:
            self._retire(tier, writer, drain, timeout)
        else:
            threading.Thread(target=self._retire, args=(tier, writer, drain, timeout),
                             name=f"kvtier-detach-{name}", daemon=True).start()

    def _retire(self, tier: GuardedTier, writer: TierWriter, drain: bool,
                timeout: float) -> None:
        retire(tier, writer, drain=drain, timeout=timeout, warn=self._warn)
        self._ctx.counters.inc("tier_detached")
        logger.info("kvtier: detached tier %s; lower tiers now %s", tier.name,
                    [t.name for t in self.tiers])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queued so far is written, `timeout` seconds in all (not per
        tier; default `blocking_timeout_secs`). False on timeout, with a warning naming the
        tiers whose writes are still queued (they land in the background)."""
        timeout = self._ctx.config.blocking_timeout_secs if timeout is None else timeout
        deadline = time.monotonic() + timeout
        # Every writer is asked, even after one ran late, and gets what time is left: a slow
        # tier must not keep the others' queues from being waited for at all.
        late = [w.backend.name for w in self.writers
                if not w.drain(max(0.0, deadline - time.monotonic()))]
        if late:
            self._warn.warning("flush", "kvtier: flush: writes to %s still queued after %.1fs; "
                               "they land in the background", ", ".join(late), timeout)
        return not late

    def stats(self) -> dict[str, float]:
        """Each lower tier's measured speeds and its writer's queue length, as `tier.name`
        entries (the tiers' own stats are the caller's: it holds the CPU tier too)."""
        out: dict[str, float] = {}
        for tier in self.tiers:
            for name, value in tier.speed.stats().items():
                out[f"{tier.name}.{name}"] = value
        for writer in self.writers:
            out[f"{writer.backend.name}.write_queue"] = writer.pending()
        return out

    def find(self, name: str) -> GuardedTier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def add(self, tier: GuardedTier, writer: TierWriter) -> None:
        """Publish `tier` (in the tier table's order) and its writer; `ValueError` if
        attached or if the set is closed (the caller still owns both then)."""
        with self._lock:
            if self._closed:
                raise ValueError(f"tier {tier.name!r} cannot be attached: storage is closed")
            if self.find(tier.name) is not None:
                raise ValueError(f"tier {tier.name!r} is already attached")
            rank = {name: i for i, name in enumerate(tier_names())}
            self.tiers = sorted([*self.tiers, tier], key=lambda t: rank.get(t.name, 99))
            self.writers = [*self.writers, writer]

    def remove(self, name: str) -> tuple[GuardedTier, TierWriter]:
        """Unpublish tier `name`; returns it and its writer. `ValueError` if not attached."""
        with self._lock:
            tier = self.find(name)
            if tier is None:
                raise ValueError(f"tier {name!r} is not attached; attached: "
                                 f"{[t.name for t in self.tiers]}")
            writer = next(w for w in self.writers if w.backend is tier)
            self.tiers = [t for t in self.tiers if t is not tier]
            self.writers = [w for w in self.writers if w is not writer]
            return tier, writer

    def close(self) -> tuple[list[GuardedTier], list[TierWriter]]:
        """Unpublish every tier and writer and refuse later `add`s; returns what was attached,
        for the caller to close (no tier is closed while still published)."""
        with self._lock:
            self._closed = True
            tiers, writers = self.tiers, self.writers
            self.tiers, self.writers = [], []
            return tiers, writers

    def shut(self, timeout: float) -> list[GuardedTier]:
        """`close`, then close the writers (their queues written within `timeout` seconds in
        all); returns the tiers, for the caller to close once nothing else reads them."""
        tiers, writers = self.close()
        deadline = time.monotonic() + timeout
        for writer in writers:
            writer.close(max(0.0, deadline - time.monotonic()))
        return tiers


MIN_SALT_BYTES = 16  # 128 bits: a salt a reader cannot search


def _warn_plain_records(config: Config, names: Sequence[str]) -> None:
    """One warning line when lower tiers `names` (disk, Redis) keep plain records: without
    `record_key_file` nothing tells a record this fleet wrote from one planted by whoever can
    write the tier (checksums catch accidents only), and the KV gives the prompts back. With
    Redis and a short `hash_salt`, the line adds that its key names let a reader test a
    guessed prompt."""
    lower = [name for name in names if name != CPU]
    if not lower or config.record_key_file is not None:
        return
    names_line = ""
    salt = len((config.hash_salt or "").encode())
    if config.remote_url is not None and salt < MIN_SALT_BYTES:
        names_line = ("; and the Redis key names are hashes of the prompts' tokens salted by "
                      f"hash_salt ({salt} bytes): whoever can list the Redis can test whether "
                      "a guessed prompt was served (a hash_salt of at least "
                      f"{MIN_SALT_BYTES} random bytes hides the names only)")
    logger.warning("kvtier: no record_key_file, so the %s tier%s keep%s plain records: anyone "
                   "who can write there can forge records that this server will serve as KV, "
                   "and anyone who can read them can read the prompts back%s; set "
                   "record_key_file to a secret shared by the servers (see docs/security.md)",
                   " and ".join(lower), "s" if len(lower) > 1 else "",
                   "" if len(lower) > 1 else "s", names_line)


def probe_tiers(tiers: Sequence[GuardedTier], nbytes: int, bound_s: float | None = None,
                ) -> None:
    """Probe `tiers` at once, each on a thread of its own, with a scratch record of `nbytes`
    (`GuardedTier.probe`), waiting `bound_s` in all (default `PROBE_BOUND_S`): a tier not
    done by then stays unmeasured (its probe finishes in the background) and is named in the
    log with why; so is one whose probe failed or could not run. Logs what each measured and
    what the probes cost."""
    if not tiers:
        return
    bound_s = PROBE_BOUND_S if bound_s is None else bound_s
    start = time.monotonic()
    runs = [_ProbeRun(tier, nbytes) for tier in tiers]
    for run in runs:
        run.thread.join(max(0.0, start + bound_s - time.monotonic()))
    for run in runs:
        speed = run.tier.speed
        if run.thread.is_alive():
            logger.warning("kvtier: tier %s: its start-up probe did not finish within %.1fs; "
                           "unmeasured: its hits load in the background until a read times "
                           "it", run.tier.name, bound_s)
        elif not run.samples:
            logger.warning("kvtier: tier %s: start-up probe not taken (the tier is down or "
                           "refused it: see the line above); unmeasured: its hits load in the "
                           "background until a read times it", run.tier.name)
        else:
            logger.info("kvtier: tier %s measured at start: round trip %.2f ms, reads %.1f "
                        "MB/s (%d KiB scratch record, %d place%s, %.0f ms)", run.tier.name,
                        speed.latency_s * 1e3, speed.read_bytes_per_s / 1e6, nbytes >> 10,
                        run.samples, "" if run.samples == 1 else "s", run.took_s * 1e3)
    logger.info("kvtier: start-up probes of %s took %.0f ms", [t.name for t in tiers],
                (time.monotonic() - start) * 1e3)


class _ProbeRun:
    """One tier's probe on a daemon thread of its own."""

    def __init__(self, tier: GuardedTier, nbytes: int) -> None:
        self.tier = tier
        self.samples = 0
        self.took_s = 0.0
        self.thread = threading.Thread(target=self._run, args=(nbytes,), daemon=True,
                                       name=f"kvtier-probe-{tier.name}")
        self.thread.start()

    def _run(self, nbytes: int) -> None:
        start = time.monotonic()
        self.samples = len(self.tier.probe(nbytes))
        self.took_s = time.monotonic() - start


def retire(tier: GuardedTier, writer: TierWriter, *, drain: bool, timeout: float,
           warn: RateLimitedLog) -> None:
    """Close a detached tier: its queued writes written (`drain`) or dropped and counted, the
    calls still running on it given up to `timeout` seconds to finish."""
    if drain:
        writer.close(timeout)
    else:
        writer.cancel(timeout)
    if not tier.wait_idle(timeout):
        warn.warning(f"detach-{tier.name}", "kvtier: calls on tier %s still running after "
                     "%.1fs; closing it under them", tier.name, timeout)
    tier.close()


def discard(tier: GuardedTier, writer: TierWriter) -> None:
    """Close a built tier that was never published (its writer has nothing queued)."""
    writer.close(0.0)
    tier.close()
