"""CacheEngine: the API a serving engine calls to store and load KV by token prefix."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.backends.codec import check_gate
from kvtier.config import Config
from kvtier.connectors.base import KVConnector
from kvtier.engine.hints import Hints, cut, retain_name
from kvtier.engine.loading import PrefixLoader
from kvtier.engine.prefill import EnginePrefill
from kvtier.engine.prefix import Prefix
from kvtier.engine.rows import limit_of
from kvtier.engine.saving import PrefixSaver
from kvtier.engine.tiers import TierControl
from kvtier.engine.verify import Verification, purge, sampled, sampling_key, shadow_check, suspect
from kvtier.kernels import ops
from kvtier.keys import ChunkKey, KeyBuilder, KeyChain, TokenIds, model_name_of
from kvtier.keys.record_keys import name_salt
from kvtier.memory import KVLayout, MemoryFormat
from kvtier.storage import StorageManager
from kvtier.storage.backlog import WriteBacklog
from kvtier.storage.prefetch.handle import Prefetch
from kvtier.storage.sessions import session_tag

if TYPE_CHECKING:
    from kvtier.connectors.streams import DeviceCopies
    from kvtier.engine.segments import SegmentStore

# `Prefetch`: the handle `start_prefetch` returns, `Prefix` the one every call takes, named
# here so callers need only this module.
__all__ = ["CacheEngine", "Prefetch", "Prefix", "TokenIds"]

logger = logging.getLogger(__name__)


class CacheEngine:
    """Stores and retrieves the KV of token prefixes for one model on one TP rank.

    Args:
        config: from `load_config()`.
        model_name: namespaces keys; engines with the same name and layout share entries.
        layout: the KV layout (must match the connector's pool).
        connector: moves chunks between the serving engine's KV pool and memory objects.
        world_size, rank: tensor-parallel position; MHA keys carry the rank, MLA keys do not
            (MLA KV is replicated on every rank, so only rank 0 stores and every rank loads).
        storage: share one StorageManager between engines (default: build one from config):
            build it, pass it to each engine and close it after them (an engine closes only
            the one it built). Its tiers change at run time through `tiers` (`TierControl`).
        page_size: the engine's KV page size in tokens: tails (`save_tails`) are whole pages.

    On a CUDA pool the chunks stay in the pinned host arena and every copy runs on kvtier's own
    CUDA streams (`connectors.streams`): `store` waits for its copy on the calling thread (call
    it off the serving thread), `retrieve` never waits: the caller's current stream waits for
    the loaded bytes before the work enqueued next.

    Raises:
        ValueError: the layout does not match the connector, or bad rank/world_size.
        ConfigError: `remote_serde` failed its quality gate for `model_name` (and
            `remote_serde_override` is off: kvtier.backends.codec.check_gate).
    """

    def __init__(
        self,
        config: Config,
        *,
        model_name: str,
        layout: KVLayout,
        connector: KVConnector,
        world_size: int = 1,
        rank: int = 0,
        storage: StorageManager | None = None,
        page_size: int = 1,
    ):
        if connector.layout != layout:
            raise ValueError(f"layout {layout} does not match the connector's pool "
                             f"{connector.layout}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, {world_size}), got {rank!r}")
        # a codec that failed its quality gate for this model: ConfigError (docs/codecs.md)
        model = model_name_of(model_name)  # the plugin's key component, percent-decoded
        if said := check_gate(config.remote_serde, model, config.remote_serde_override):
            logger.warning("kvtier: %s", said)
        if config.log_level:
            logging.getLogger("kvtier").setLevel(config.log_level.upper())
        ops.prepare()  # the copy kernel is compiled here, never on a serving thread
        self.config = config
        self.layout = layout
        self.connector = connector
        mla = layout.fmt is MemoryFormat.KV_MLA
        self._writes_down = not mla or rank == 0  # MLA: the same KV on every rank (saving.py)
        self.keys = KeyBuilder(
            model=model_name, fingerprint=layout.fingerprint(config.chunk_size),
            chunk_size=config.chunk_size, rank=0 if mla else rank,
            world_size=1 if mla else world_size,
            salt=name_salt(config.hash_salt, config.record_key_file),
            save_unfull_chunk=config.save_unfull_chunk, namespace=config.key_namespace,
            tails=config.save_tails, page_size=page_size)
        self._storage = storage or StorageManager(config, layout)
        self._stores = self._writes_down or self._storage.hot.keeps_puts
        self._storage.counters.declare("tokens_stored", "tokens_loaded", "tokens_requested",
                                      "store_no_memory")
        self._owns_storage = storage is None
        self.tiers = TierControl(self._storage)  # the tiers at run time: attach, remove, ...
        # the engine's prefill speed: fed by its prefills, weighed against loads and blends
        self.prefill = EnginePrefill(self._storage.prefill, connector.device, layout.dtype)
        self._device: DeviceCopies | None = None
        if connector.device.type == "cuda":
            from kvtier.connectors.streams import DeviceCopies

            self._device = DeviceCopies(connector, self._storage.counters)
        self._saver = PrefixSaver(self._storage, layout, connector, self._device,
                                  self._writes_down)
        self._loader = PrefixLoader(self._storage, connector, self._device, config.chunk_size)
        if config.metrics_port is not None:
            from kvtier import prometheus

            prometheus.serve_rank(config.metrics_port + rank)
        self.verify_fraction = config.verify_fraction  # both changed at run time (admin route)
        self.verify_scope = config.verify_scope
        self.sampling_key = sampling_key()  # secret: clients set request ids (verify.sampled)
        self._closed = False

    def prefix(self, token_ids: TokenIds, salt: str = "") -> Prefix:
        """The handle of `token_ids` under `salt` (a per-request salt, e.g. SGLang's
        `cache_salt`: see `chunk_keys`) that `lookup`, `start_prefetch`, `retrieve`, `store`
        and `verify` take in place of token ids: its keys are hashed once, at first use."""
        return Prefix(token_ids, salt, self.keys)

    def store(self, token_ids: TokenIds | Prefix, slot_mapping: torch.Tensor, *,
              session_id: str | None = None, on_read: Callable[[], None] | None = None,
              salt: str = "", also_prefix: int | None = None,
              ready: torch.cuda.Event | None = None, known: int = 0,
              hints: Hints | None = None) -> int:
        """Save the KV of `token_ids` (in pool rows `slot_mapping`) chunk by chunk; returns the
        tokens newly stored. Chunks the CPU tier holds are skipped (lower tiers' writers skip
        what they hold); storing stops at the first `-1` slot or chunk that finds no memory.

        `on_read`: called once the pool rows are read (the caller may reuse them from then on).
        `session_id`: pin the prefix in the CPU tier as that session's latest turn (see
        `release_session`). `salt`: the request's salt (see `chunk_keys`). `also_prefix`: a
        shorter prefix whose own tail is stored too, uncounted, if it ends inside any chunk
        (SGLang: the prompt less its last token, which a repeat loads whatever the answer's
        length). `ready` (CUDA pools): the event recorded after the forward that wrote
        the KV (None: what the caller's current stream holds now). `known`: the leading tokens
        found in the tiers at admission; without a CPU tier to skip them by (`local_cpu:
        false`), their whole chunks are not stored again (writers keep a chunk's predecessors).
        `hints`: what is retained, and never stored (`kvtier.engine.hints`). `token_ids` may
        be a `Prefix` (then without `salt`: it carries its own).
        """
        prefix = self._handle(token_ids, salt)
        token_ids, slot_mapping, also_prefix = cut(hints, prefix.token_ids, slot_mapping,
                                                   also_prefix)
        prefix = prefix.cut(len(token_ids))
        salt = prefix.salt
        keys, slots, lowest = self._prepare(token_ids, slot_mapping, prefix.keys)
        if not self._stores or self._closed or not keys:
            if on_read is not None:
                on_read()
            return 0
        extra = self.keys.inner_tail(token_ids, keys, also_prefix, salt)
        todo = keys
        if known > 0 and not self._storage.hot.keeps_puts:
            todo = [k for k in keys if k.end > known]
            extra = None if extra is not None and extra.end <= known else extra
        retain = hints.retain_s if hints is not None else None
        stored = self._saver.save(todo, slots, on_read, extra, ready,  # reuse declared: admitted
                                  unwritten=lowest is None or lowest < 0,
                                  declared=session_id is not None or retain is not None)
        if session_id is not None:
            self._storage.pin_session(session_id, keys)
        if retain is not None:
            self._storage.sessions.retain(retain_name(keys), keys, retain)
        return stored

    def verify(self, token_ids: TokenIds | Prefix, slot_mapping: torch.Tensor, *, start: int = 0,
               loaded: bool = False, session_id: str | None = None,
               on_read: Callable[[], None] | None = None, salt: str = "",
               also_prefix: int | None = None, ready: torch.cuda.Event | None = None,
               hints: Hints | None = None) -> Verification:
        """`store`, after comparing the KV in `slot_mapping` with every tier's records of the full
        chunks from the one holding token `start` on (what the request computed): a chunk over
        `verify.TOLERANCE` is counted, logged and removed from its tier with the chunks after it;
        the store writes the fresh KV. `loaded` (scope tail): the tokens before `start` came from
        the tiers; if that prefix is `verify.suspect`, all chunks leave every tier, none stored.
        `token_ids` may be a `Prefix` (then without `salt`)."""
        prefix = self._handle(token_ids, salt)
        _, slots, _ = self._prepare(prefix.token_ids, slot_mapping, prefix.keys)
        keys = prefix.chain
        verdicts = [] if self._closed else shadow_check(
            self._storage, keys, start, lambda todo: self._saver.fill(todo, slots, ready))
        if loaded and suspect(self._storage, keys, start, verdicts):
            if on_read is not None:  # nothing of the request is stored
                on_read()
            return Verification(0, verdicts, purge(self._storage, keys))
        stored = self.store(prefix, slot_mapping, session_id=session_id, on_read=on_read,
                            also_prefix=also_prefix, ready=ready, hints=hints)
        return Verification(stored, verdicts)

    def verifies(self, request_id: str, scope: str | None = None) -> bool:
        """Whether request `request_id` is sampled (`verify.sampled`), in scope `scope` if named."""
        return (scope is None or scope == self.verify_scope) and \
            sampled(request_id, self.verify_fraction, self.sampling_key)

    def retrieve(self, token_ids: TokenIds | Prefix, slot_mapping: torch.Tensor, skip: int = 0, *,
                 hot_only: bool = False, session_id: str | None = None,
                 keys: Sequence[ChunkKey] | None = None, salt: str = "",
                 limit: int | None = None) -> int:
        """Load cached KV of the longest cached prefix of `token_ids` into `slot_mapping`.

        Tokens before `skip` are already in the pool and are not written; `-1` slots are not
        written. Stops at the first chunk no tier has (only the CPU tier is read with
        `hot_only`), then loads the longest tail stored after it (`save_tails`). Chunks are
        scattered as they arrive, while later ones are still being read. `keys`:
        `key_chain(token_ids, salt)` computed earlier (a long prompt is hashed once; the chain
        carries its salt, so `salt` is not given with it; a plain list of keys finds no
        tails). `limit`: load at most this many leading tokens; the
        tokens after it still name the chunks, so a chunk the limit cuts is loaded in part.
        Returns the number of leading tokens now in the pool (at least `skip`). `token_ids`
        may be a `Prefix` (then without `keys` or `salt`: it carries its chain).
        """
        token_ids, chain = self._named(token_ids, keys, salt)
        keys, slots, _ = self._prepare(token_ids, slot_mapping, chain)
        if not isinstance(skip, int) or not 0 <= skip <= slots.numel():
            raise ValueError(f"skip must be an int in [0, {slots.numel()}], got {skip!r}")
        limit = limit_of(limit, slots.numel())
        wanted = [k for k in keys if k.end > skip and k.start < limit]
        if session_id is not None:
            self._storage.touch_session(session_id)
        if self._closed or skip >= limit:
            return skip
        loaded, asked = self._loader.load(keys, wanted, slots, skip, limit, hot_only=hot_only)
        loaded = min(loaded, limit)
        self._storage.unstage(asked)  # `local_cpu: false`: delivered, so no longer held
        self._storage.counters.inc("tokens_loaded", loaded - skip)
        self._storage.counters.inc("tokens_requested", limit - skip)
        return loaded

    def lookup(self, token_ids: TokenIds | Prefix, *, hot_only: bool = False,
               keys: Sequence[ChunkKey] | None = None, salt: str = "",
               limit: int | None = None) -> int:
        """How many leading tokens of `token_ids` (at most `limit`) some tier (only the CPU
        tier with `hot_only`) could load, to the end of the longest stored tail; no data
        moves. `token_ids` (or a `Prefix`), `keys`, `salt`, `limit`: as in `retrieve`."""
        token_ids, keys = self._named(token_ids, keys, salt)
        if self._closed:
            return 0
        limit = limit_of(limit, len(token_ids))
        usable = [k for k in keys if k.start < limit]
        n = self._storage.contains(usable, hot_only=hot_only)
        end = usable[n - 1].end if n else 0
        tail = self._loader.tail(keys, end, limit, hot_only=hot_only)
        return min(limit, tail[0].end if tail else end)

    def start_prefetch(self, token_ids: TokenIds | Prefix, *,
                       keys: Sequence[ChunkKey] | None = None,
                       salt: str = "", limit: int | None = None) -> Prefetch:
        """Start moving the lower-tier chunks of `token_ids`, and the longest tail after them,
        into CPU memory in the background and return at once; poll the handle's `ready()`
        (per `prefetch_policy`) or wait on it, and `cancel()` it when the request goes away.
        When the CPU tier holds all of it, the handle is done at once, with no keys.
        See `StorageManager.start_prefetch`. `token_ids` (or a `Prefix`), `keys`, `salt`,
        `limit`: as in `retrieve`."""
        if self._closed:
            return self._storage.start_prefetch([])
        token_ids, keys = self._named(token_ids, keys, salt)
        limit = limit_of(limit, len(token_ids))
        if self.lookup(token_ids, hot_only=True, keys=keys, limit=limit) >= limit:
            return self._storage.start_prefetch([])  # all in the CPU tier: nothing to load
        return self._storage.start_prefetch(keys.upto(limit) if isinstance(keys, KeyChain)
                                           else [k for k in keys if k.start < limit])

    def prefetch(self, token_ids: TokenIds | Prefix) -> Prefetch:
        """Move lower-tier chunks of `token_ids` (or a `Prefix`) into CPU memory, waiting as
        `prefetch_policy` says (`best_effort`: not at all)."""
        keys = [] if self._closed else self._named(token_ids, None, "")[1]
        return self._storage.prefetch(keys)

    def release_session(self, session_id: str) -> bool:
        """Unpin the chunks `store(..., session_id=)` pinned (logged with the session's tag,
        never its id); False if the session held none. Sessions idle for `session_ttl_secs`
        are released by themselves."""
        released = self._storage.release_session(session_id)
        if released:
            logger.info("kvtier: session %s closed; its prefix is no longer pinned",
                        session_tag(session_id))
        return released

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the lower-tier writes queued so far have landed, `timeout` seconds at
        most (default `blocking_timeout_secs`); False if some are still queued."""
        return self._storage.flush(timeout)

    def write_backlog(self) -> WriteBacklog:
        """Lower-tier writes written, pending and lost so far: what a drain reports."""
        return self._storage.write_backlog()

    def chunk_keys(self, token_ids: TokenIds, salt: str = "") -> list[ChunkKey]:
        """The keys `store` puts `token_ids` under (whole chunks, then the partial one per
        `save_unfull_chunk`/`save_tails`); with `salt` (a per-request salt, e.g. SGLang's
        `cache_salt`), keys only requests with the same salt share."""
        return self.keys.keys(token_ids, salt)

    def key_chain(self, token_ids: TokenIds, salt: str = "") -> KeyChain:
        """The keys `lookup`, `retrieve` and `start_prefetch` walk for `token_ids`: its full
        chunks, and the tails that may follow them (see `KeyChain`)."""
        return self.keys.chain(token_ids, salt)

    def segments(self) -> SegmentStore:
        """The store of segments' standalone KV (reuse at any position, `kvtier.blend`) in
        this engine's tiers and keys; `ValueError` for MLA."""
        from kvtier.engine.segments import SegmentStore

        return SegmentStore(self._storage, self.keys, self.layout, write_down=self._writes_down)

    def stats(self) -> dict[str, float]:
        """The counters, and every tier's stats as `tier.stat` entries (`StorageManager.stats`)."""
        return self._storage.stats()

    @property
    def storage(self) -> StorageManager:
        """Deprecated (issue 73; removed in the next release): the storage manager is the
        engine's own. `DeprecationWarning` at each read (shown once per calling line)."""
        warnings.warn("CacheEngine.storage is deprecated and goes in the next release: use "
                      "engine.stats(), engine.flush(), engine.tiers (names, attach, detach, "
                      "remove, watch), or build a StorageManager and pass it as storage= to "
                      "each engine that shares it", DeprecationWarning, stacklevel=2)
        return self._storage

    def close(self) -> None:
        """Drain background writes, then release the tiers and the arena. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._device is not None:  # loads still copying hold arena objects
            self._device.close(self.config.blocking_timeout_secs)
        if self._owns_storage:
            self._storage.close()
            self._saver.close()  # its writers drained: nothing holds the write-around buffer

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handle(self, token_ids: TokenIds | Prefix, salt: str) -> Prefix:
        """`token_ids` as a `Prefix` (given, or made under `salt`)."""
        if not isinstance(token_ids, Prefix):
            return self.prefix(token_ids, salt)
        if salt:
            raise ValueError("salt: a Prefix carries its own; give it to prefix(), not here")
        if not token_ids.named_by(self.keys):  # its keys name another model, layout or rank
            raise ValueError("token_ids: a Prefix made by another engine; use this engine's "
                             "prefix()")
        return token_ids

    def _named(self, token_ids: TokenIds | Prefix, keys: Sequence[ChunkKey] | None,
               salt: str) -> tuple[TokenIds, Sequence[ChunkKey]]:
        """The tokens and the chain a load walks: a `Prefix`'s own, else `keys` as given (a
        chain carries its salt), else `token_ids`' chain under `salt`."""
        if isinstance(token_ids, Prefix):
            if keys is not None:
                raise ValueError("keys: a Prefix carries its own chain; give one or the other")
            return self._handle(token_ids, salt).token_ids, token_ids.chain
        if keys is not None and salt:
            raise ValueError("salt: give it to key_chain(token_ids, salt), not beside keys=")
        return token_ids, self.key_chain(token_ids, salt) if keys is None else keys

    def _prepare(self, token_ids: TokenIds, slot_mapping: torch.Tensor,
                 keys: Sequence[ChunkKey] | None = None,
                 ) -> tuple[Sequence[ChunkKey], torch.Tensor, int | None]:
        """The keys `store` writes (or the chain a load walks, given), the checked slots and
        the smallest slot (None on a GPU)."""
        keys = self.keys.keys(token_ids) if keys is None else keys
        lowest = self.connector.check_slots(slot_mapping, name="slot_mapping")
        n = len(token_ids)
        if slot_mapping.numel() != n:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries, token_ids has {n}")
        if keys and keys[-1].end > n:
            raise ValueError(f"keys cover {keys[-1].end} tokens, token_ids has {n}")
        return keys, slot_mapping, lowest
