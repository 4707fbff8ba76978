"""RedisBackend: the tier's storage calls on router.Router, io and health.Health.

Configuration, failure handling and counters are described in the package docstring.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence

import redis
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError

from kvtier.backends import record
from kvtier.backends.base import BackendContext, ProbeSample, StorageBackend
from kvtier.backends.redis import batches
from kvtier.backends.redis import io as rio
from kvtier.backends.redis.health import Health
from kvtier.backends.redis.probe import probe_primaries
from kvtier.backends.redis.router import Router
from kvtier.backends.redis.url import parse_remote_url
from kvtier.config.names import REDIS
from kvtier.errors import ConfigError, CorruptEntry
from kvtier.keys import ChunkKey
from kvtier.memory import MemoryObj

__all__ = ["RedisBackend"]

logger = logging.getLogger(__name__)

_TIER_ERRORS = (RedisError, RedisClusterException, OSError)
# Reply bytes requested ahead per connection in a batch_get. Split reads want a few MiB: Redis
# then reuses warm reply buffers (2-16 MiB measured alike); MGETs want two 32 MiB chunks.
_WINDOW = {True: 4 << 20, False: 64 << 20}
# Encrypted puts: ciphertext bytes per round trip, and what the tier keeps of its buffers
# (rio.CipherBuffers: fresh ones halved 32 MiB puts; a group at 2 GB/s is ~30 ms, so the
# round trips between groups cost nothing measurable).
_SEAL_GROUP = 64 << 20
_STATS = ("hits", "misses", "puts", "write_errors", "corrupt", "forged", "segment_mismatches",
          "alloc_failures", "errors", "skipped_down", "down_events", "bytes_read",
          "bytes_written", "rereads", "other_version")

class RedisBackend(StorageBackend):
    """Chunks as records in Redis. Thread-safe: each call takes pooled connections per node."""

    name = REDIS

    def __init__(self, ctx: BackendContext, *, atomic_reads: bool = False):
        """`atomic_reads`: read a segmented record with one MGET instead of one GET per
        segment (slower on large chunks; both validate every record, see io.py)."""
        cfg = ctx.config
        self._split = not atomic_reads
        if not cfg.remote_url:
            raise ConfigError("remote_url: the redis tier needs a redis:// ... URL")
        self._target = parse_remote_url(cfg.remote_url)
        self.ctx = ctx  # public: the layout and arena its records are read into
        self._keys = ctx.record_key
        self._buffers = rio.CipherBuffers(_SEAL_GROUP)
        self._ttl = cfg.remote_ttl_secs
        self._timeout = cfg.remote_timeout_secs
        self._seg = max(1, int(cfg.remote_segment_mb * (1 << 20)))
        self._codec = ctx.codec
        self._router: Router | None = None
        self._health = Health(f"redis tier {self._target.url}", self._probe, _TIER_ERRORS,
                              ctx.counters.scope(self.name, *_STATS))
        try:
            self._connect()
        except AuthenticationError as exc:
            self.close()
            raise ConfigError(f"remote_url {self._target.url!r}: authentication failed: "
                              f"{exc}") from None
        except RedisClusterException as exc:
            if "not enabled" not in str(exc):  # "Cluster mode is not enabled on this node"
                self._health.failed("connect", exc)
            else:
                self.close()
                raise ConfigError(f"remote_url {self._target.url!r}: {exc}") from None
        except _TIER_ERRORS as exc:
            self._health.failed("connect", exc)
        except Exception as exc:  # a server answering what redis-py cannot parse: down too
            self._health.failed("connect", exc)
        else:
            logger.info("redis tier connected: %s", self._target.url)

    def _connect(self) -> None:
        router = self._router
        if router is None:
            router = Router(self._target, self._timeout)  # a cluster reads its slot map here
            if self._health.closed.is_set():
                router.close()
                raise RedisError("tier closed")
            self._router = router
        router.ping()

    def _probe(self) -> None:
        if self._router is not None:
            self._router.disconnect()  # pooled sockets to a restarted server are stale
        try:
            self._connect()
        except AuthenticationError as exc:
            self._health.warn("auth", "authentication failed while reconnecting: %s", exc)
            raise

    def _usable(self) -> Router | None:
        router = self._router
        if self._health.closed.is_set():
            return None
        if self._health.down or router is None:
            self._health.count("skipped_down")
            return None
        return router

    def _reply_error(self, op: str, exc: rio.ReplyError) -> None:
        self._health.count("errors")
        if str(exc).startswith(("MOVED", "ASK")) and self._router is not None:
            try:
                self._router.refresh()
            except _TIER_ERRORS as err:
                self._health.failed("refresh", err)
        self._health.warn("reply", "%s: server replied %s", op, exc)

    def probe(self, nbytes: int) -> list[ProbeSample]:
        router = self._usable()
        if router is None or nbytes <= 0:
            return []
        # A load moves the codec's bytes: time a scratch value of that size, reported as the
        # decoded bytes it stands for (what loads are planned and observed in), so a slow tier
        # storing fp8 is planned to pay off sooner.
        layout, chunk = self.ctx.layout, self.ctx.config.chunk_size
        wire = -(-nbytes * self._codec.payload_nbytes(layout, chunk) // layout.nbytes(chunk))
        try:
            samples = probe_primaries(router, wire, self.ctx.config.key_namespace)
            return [s._replace(read_bytes=nbytes) if s.read_bytes == wire else s
                    for s in samples]
        except rio.ReplyError as exc:  # e.g. OOM, READONLY or NOPERM: unmeasured, not down
            self._health.warn("probe", "probe: server replied %.300s", exc)
        except _TIER_ERRORS as exc:
            self._health.failed("probe", exc)
        return []

    def batch_contains(self, keys: Sequence[ChunkKey]) -> int:
        found = self._exists(keys, "contains")
        return found.index(False) if False in found else len(found)

    def first_held(self, keys: Sequence[ChunkKey]) -> int:
        found = self._exists(keys, "first_held")
        return found.index(True) if True in found else -1

    def _exists(self, keys: Sequence[ChunkKey], op: str) -> list[bool]:
        """Whether each of `keys` is stored whole, in one round trip per node; all False when
        the tier is down."""
        router = self._usable()
        if router is None or not keys:
            return [False] * len(keys)
        names = [rkeys for rkeys, _ in batches.plan(keys, self.ctx.layout, self._seg)]
        found = [False] * len(keys)
        try:
            for client, idxs in batches.by_node(router, names):  # one round trip per node
                out = rio.CommandWriter()
                for i in idxs:
                    out.command("EXISTS", *names[i])
                for i, (n,) in zip(idxs, rio.exchange(client, out.finish(), [1] * len(idxs))):
                    found[i] = n == len(names[i])
        except _TIER_ERRORS as exc:
            self._health.failed(op, exc)
            return [False] * len(keys)
        return found

    def batch_get(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        return list(self.iter_get(keys))

    def iter_get(self, keys: Sequence[ChunkKey]) -> Generator[MemoryObj, None, None]:
        """Every chunk's GETs are pipelined at once (per node); each chunk is yielded as soon
        as its record is read and verified, while later replies are still arriving."""
        router = self._usable()
        if router is None or not keys:
            return
        hits = nbytes_read = 0
        bad: list[tuple[redis.Redis, list[str]]] = []
        streams: dict[int, rio.GetStream] = {}
        layout, allocate = self.ctx.layout, self.ctx.allocate
        try:
            order = []
            for rkeys, nbytes in batches.plan(keys, self.ctx.layout, self._seg):
                client = router.node_for(rkeys[0])
                stream = streams.setdefault(
                    id(client), rio.GetStream(client, _WINDOW[self._split], self._split))
                stream.add(rkeys, nbytes)
                order.append((stream, rkeys))
            for k, (stream, rkeys) in zip(keys, order):
                try:
                    obj = rio.read_record(stream, k, layout, len(rkeys), allocate,
                                          self._keys)
                except (CorruptEntry, rio.ReplyError, rio.ArenaFull) as exc:
                    obj = self._after_failed_read(stream, k, rkeys, exc, bad)
                    if obj is not None:
                        hits, nbytes_read = hits + 1, nbytes_read + obj.nbytes
                        yield obj
                    break  # the stream may be half-read
                stream.done()
                if obj is None:
                    break
                hits, nbytes_read = hits + 1, nbytes_read + obj.nbytes
                yield obj
        except _TIER_ERRORS as exc:
            self._health.failed("get", exc)
        finally:
            for stream in streams.values():
                stream.close()
            self._health.count("hits", hits)
            self._health.count("misses", int(hits < len(keys)))
            self._health.count("bytes_read", nbytes_read)
            self._delete(bad)

    def _after_failed_read(self, stream: rio.GetStream, key: ChunkKey, rkeys: list[str],
                           exc: Exception, bad: list[tuple[redis.Redis, list[str]]],
                           ) -> MemoryObj | None:
        """Handle a read that failed: the record read atomically when the failure may be a
        race of a split read (see io.py), else None with the failure counted and the keys
        added to `bad` when the stored value must be deleted."""
        # (A KeyMismatch is the header's verdict, not a race: a re-read cannot change it.)
        if (stream.split and len(rkeys) > 1 and isinstance(exc, CorruptEntry)
                and not isinstance(exc, (rio.SegmentMismatch, record.KeyMismatch))):
            self._health.count("rereads")
            try:
                return rio.read_atomic(stream.client, key, rkeys, self.ctx.layout,
                                       self.ctx.allocate, self._keys)
            except (CorruptEntry, rio.ReplyError, rio.ArenaFull) as again:
                exc = again
        if self._get_failed(key, exc):
            bad.append((stream.client, rkeys))
        return None

    def _get_failed(self, key: ChunkKey, exc: Exception) -> bool:
        """Count why a read stopped; True when the stored value must be deleted."""
        if isinstance(exc, rio.ArenaFull):
            self._health.count("alloc_failures")
            return False
        if isinstance(exc, rio.SegmentMismatch):
            self._health.count("segment_mismatches")
            self._health.warn("segments", "%s: %s, this instance uses %d; set the same "
                              "remote_segment_mb everywhere", key.key, exc, self._seg)
            return False
        if isinstance(exc, rio.ReplyError) and not str(exc).startswith("WRONGTYPE"):
            self._reply_error("get", exc)
            return False
        # (WRONGTYPE: a non-string value is not our record either)
        if isinstance(exc, (record.ForgedEntry, record.OtherVersion)):  # never deleted
            what = "forged" if isinstance(exc, record.ForgedEntry) else "other_version"
            self._health.count(what)
            self._health.warn(what, "%s: %s; a miss (left in place)", key.key, exc)
            return False
        self._health.count("corrupt")
        self._health.warn("corrupt", "%s: %s; deleted", key.key, exc)
        return True

    def _delete(self, items: list[tuple[redis.Redis, list[str]]]) -> int:
        """DEL each item's keys, one round trip per node; how many items existed."""
        groups: dict[int, tuple[redis.Redis, rio.CommandWriter, list[int]]] = {}
        for client, rkeys in items:
            _, out, counts = groups.setdefault(id(client), (client, rio.CommandWriter(), []))
            out.command("DEL", *rkeys)
            counts.append(1)
        removed = 0
        try:
            for client, out, counts in groups.values():
                for (n,) in rio.exchange(client, out.finish(), counts):
                    removed += int(isinstance(n, int) and n > 0)
        except _TIER_ERRORS as exc:
            self._health.failed("delete", exc)
        return removed

    def batch_put(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj]) -> int:
        if len(keys) != len(objs):
            raise ValueError(f"keys and objs differ in length: {len(keys)} != {len(objs)}")
        layout = self.ctx.layout
        for i, (k, obj) in enumerate(zip(keys, objs)):
            if obj.nbytes != layout.nbytes(k.num_tokens) or obj.fmt != layout.fmt:
                raise ValueError(f"objs[{i}]: {obj!r} does not hold {k.num_tokens} tokens of "
                                 "the tier's layout")
        router = self._usable()
        if router is None or not keys:
            return 0
        plan = batches.plan(keys, self.ctx.layout, self._seg)
        stored = written = 0
        try:
            recs = [self._codec.encode(obj) for obj in objs]  # on the writer's thread
            segs = [rio.segment_bytes(len(rec.byte_view()), len(rk), self._seg)
                    for rec, (rk, _) in zip(recs, plan)]
            # Every seal (and so every check) first: a ValueError leaves nothing half-sent.
            seals = [record.seal_for(k, rec, segment_bytes=seg, keys=self._keys)
                     for k, rec, seg in zip(keys, recs, segs)]
            for client, idxs in batches.by_node(router, [rk for rk, _ in plan]):
                for group in batches.put_groups(idxs, plan, _SEAL_GROUP if self._keys else None):
                    # Encrypted records are sent from ciphertext buffers, a group at a time.
                    bufs = [self._buffers.take(plan[i][1]) for i in group] if self._keys else []
                    try:
                        out = rio.CommandWriter()
                        counts = []
                        for j, i in enumerate(group):
                            head, payload = record.seal_record(
                                keys[i], recs[i], seals[i],
                                bufs[j][:recs[i].nbytes] if bufs else None,
                                segment_bytes=segs[i])
                            counts.append(rio.write_record(out, plan[i][0], head, payload,
                                                           segs[i] or self._seg, self._ttl))
                        answers = rio.exchange(client, out.finish(), counts)
                    finally:
                        self._buffers.give(bufs)
                    for i, replies in zip(group, answers):
                        last = replies[-1]
                        if last == b"OK" or (len(replies) > 1 and isinstance(last, list)):
                            stored += 1
                            written += plan[i][1]  # in the pool's dtype, as bytes_read
                            continue
                        self._health.count("write_errors")
                        err = next((r for r in replies if isinstance(r, rio.ReplyError)), None)
                        self._reply_error("put", err or rio.ReplyError(f"unexpected {last!r}"))
        except _TIER_ERRORS as exc:
            self._health.failed("put", exc)
        self._health.count("puts", stored)
        self._health.count("bytes_written", written)
        return stored

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        router = self._usable()
        if router is None or not keys:
            return 0
        names = [rkeys for rkeys, _ in batches.plan(keys, self.ctx.layout, self._seg)]
        try:
            items = [(router.node_for(rkeys[0]), rkeys) for rkeys in names]
        except _TIER_ERRORS as exc:
            self._health.failed("remove", exc)
            return 0
        return self._delete(items)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self._health.counts())
        out["down"] = float(self._health.down)
        return out

    def close(self) -> None:
        self._health.close(timeout=2 * self._timeout + 1)
        router, self._router = self._router, None
        if router is not None:
            router.close()
