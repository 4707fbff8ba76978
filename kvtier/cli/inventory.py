"""What the disk and Redis tiers of a config hold, per model and layout; and deleting it.

Keys name their namespace, model and layout
(`kvtier/v2/{namespace}/{model}@{fingerprint}/{layout}/{rank}of{world}/{digest}`), so
both tiers can be listed without a running engine: the disk tier by reading each record's
header (its key string, checksummed), Redis by `SCAN MATCH kvtier/v2/{namespace}/*` on every
primary (never `KEYS`, which would block the server). Used by `kvtier stats | ls | purge`.

On disk only what the tier itself would use is looked at, and deleted: a root that is not the
filesystem root, a home or system directory, nor reached through a symlink (`ConfigError`
naming `local_disk`), and under it only files named as records in private `ab/cd`
directories, read and unlinked without following a symlink (`backends.disk.paths`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.backends import check_dependencies
from kvtier.backends.disk import files as rf
from kvtier.backends.disk import paths
from kvtier.backends.disk.owners import read_record_key
from kvtier.config import Config
from kvtier.config.names import DISK, REDIS
from kvtier.errors import ConfigError
from kvtier.keys import ALL_KEYS, KeySpace, key_of_redis_name, model_name_of

__all__ = ["Entry", "Group", "Listing", "purge", "survey"]

logger = logging.getLogger(__name__)

SCAN_BATCH = 1000


@dataclass(frozen=True)
class Entry:
    """One stored chunk: its tier, key string, size in bytes and where it lives."""

    tier: str
    key: str
    nbytes: int
    location: tuple[str, ...]  # disk: (path,); redis: its Redis keys (segments included)

    @property
    def model(self) -> str:
        """The model's name as it was served (decoded from its key component)."""
        parsed = KeySpace.parse(self.key)
        return model_name_of(parsed[0].model) if parsed else "?"

    @property
    def layout(self) -> str:
        """The model's fingerprint and the KV layout."""
        parsed = KeySpace.parse(self.key)
        if not parsed:
            return "?"
        identity = parsed[0].model.rpartition("@")[2] if "@" in parsed[0].model else "-"
        return f"{identity} {parsed[0].layout}"

    @property
    def namespace(self) -> str | None:
        parsed = KeySpace.parse(self.key)
        return parsed[0].namespace if parsed else None


@dataclass(frozen=True)
class Group:
    """The chunks of one model and layout in one tier."""

    tier: str
    model: str
    layout: str
    chunks: int
    nbytes: int


@dataclass(frozen=True)
class Listing:
    """What one lower tier holds, or why it could not be listed (`error`: the tier is down or
    refuses kvtier; its groups are then empty)."""

    tier: str
    groups: list[Group]
    error: str | None = None


@dataclass(frozen=True)
class _Found:
    tier: str
    found: list[Entry]
    error: str | None


def survey(config: Config, model: str | None = None) -> list[Listing]:
    """One `Listing` per disk/Redis tier of the config, in tier order: a tier that cannot be
    reached is a listing with its `error`, so the others are still shown. `ConfigError`
    (a `local_disk` the tier would refuse) is raised: it is the config's fault, not the
    tier's state."""
    return [Listing(f.tier, _sum(iter(f.found)), f.error) for f in _survey_entries(config, model)]


def _survey_entries(config: Config, model: str | None = None) -> list[_Found]:
    out = []
    for tier in config.tiers:
        if tier not in (DISK, REDIS):
            continue
        try:
            found = list(_select(_tier_entries(config, tier), config.key_namespace, model))
        except ConfigError:
            raise
        except Exception as exc:  # a down or refusing tier is a row, never the command's end
            out.append(_Found(tier, [], _reason(exc)))
            continue
        out.append(_Found(tier, found, None))
    return out


def _reason(exc: Exception) -> str:
    if type(exc).__module__.startswith("redis"):
        return f"unreachable: {str(exc) or type(exc).__name__}"
    return str(exc) or type(exc).__name__


def _tier_entries(config: Config, tier: str) -> Iterator[Entry]:
    if tier == DISK:
        assert config.local_disk_path is not None
        return _disk_entries(config.local_disk_path)
    return _redis_entries(config, config.key_namespace)


def _select(found: Iterator[Entry], namespace: str, model: str | None) -> Iterator[Entry]:
    return (e for e in found if e.namespace in (namespace, None)
            and (model is None or e.model == model))


def _sum(found: Iterator[Entry]) -> list[Group]:
    sums: dict[tuple[str, str, str], list[int]] = {}
    for e in found:
        total = sums.setdefault((e.tier, e.model, e.layout), [0, 0])
        total[0] += 1
        total[1] += e.nbytes
    out = [Group(t, m, lay, c, b) for (t, m, lay), (c, b) in sums.items()]
    return sorted(out, key=lambda g: (-g.nbytes, g.tier, g.model))


def purge(config: Config, model: str | None = None) -> list[Listing]:
    """Delete what `survey` lists; one `Listing` per tier of what was deleted, or of why
    nothing could be (a tier that is down is reported, the others are still purged)."""
    out = []
    for listing in _survey_entries(config, model):
        if listing.error is not None:
            out.append(Listing(listing.tier, [], listing.error))
            continue
        try:
            gone = _delete(config, listing.tier, listing.found)
        except Exception as exc:  # down between the listing and the delete
            out.append(Listing(listing.tier, [], _reason(exc)))
            continue
        out.append(Listing(listing.tier, _sum(iter(gone))))
    return out


def _delete(config: Config, tier: str, found: list[Entry]) -> list[Entry]:
    if tier == REDIS:
        if found:
            _redis_delete(config, [rkey for e in found for rkey in e.location])
        return found
    gone = []
    for e in found:
        path = Path(e.location[0])
        if paths.unlink_record(path.parents[2], path.name):
            gone.append(e)  # else gone meanwhile, or no longer a record file of ours
    return gone


def disk_root(path: Path) -> Path:
    """The disk tier's root `path` made absolute; `ConfigError` naming `local_disk` when the
    tier would refuse it (`paths.root_problem`, a symlink on the way)."""
    root = Path(os.path.abspath(path))
    why = paths.root_problem(root)
    link = paths.first_symlink(root)
    if why is None and link is not None:
        why = f"goes through the symlink {link}"
    if why is not None:
        raise ConfigError(f"local_disk: {root} {why}; the disk tier refuses it, and kvtier "
                          "lists and deletes nothing there")
    return root


def _disk_entries(path: Path) -> Iterator[Entry]:
    root = disk_root(path)
    if not root.is_dir():
        return
    dirs = rf.RecordDirs(root)
    found, _ = rf.scan(root, dirs)  # never enters a directory that is not private
    for _, name, size in found:
        try:  # O_NOFOLLOW | O_NONBLOCK, regular files only
            key = read_record_key(dirs, name) or "corrupt"  # corrupt: listed as model "?"
        except rf.NotRegular:
            continue  # not a record file of ours: neither listed nor deleted
        except OSError:
            continue  # gone meanwhile
        yield Entry(DISK, key, size, (str(rf.record_path(root, name)),))


def _router(config: Config):  # noqa: ANN202 - redis-py types only when the extra is there
    check_dependencies(REDIS)
    from kvtier.backends.redis.url import Router, parse_remote_url

    assert config.remote_url is not None
    return Router(parse_remote_url(config.remote_url), config.remote_timeout_secs)


def _redis_entries(config: Config, namespace: str) -> Iterator[Entry]:
    router = _router(config)
    try:
        for client in router.primaries():
            yield from _scan_node(client, namespace)
    finally:
        router.close()


def _scan_node(client, namespace: str) -> Iterator[Entry]:  # noqa: ANN001
    """The records of `namespace` on one node. SCAN is not filtered by ACL key patterns, so
    it is asked for this namespace only (`MATCH`): a tenant never lists another's names. A
    record this user may not read (NOPERM) is skipped and counted in a warning."""
    segments: dict[str, list[str]] = {}  # key string -> its record's Redis names
    # Namespaces are [A-Za-z0-9._-]: nothing in them is a glob character.
    pattern = ALL_KEYS.removesuffix("*") + f"{namespace}/*"
    denied = 0
    for raw in client.scan_iter(match=pattern, count=SCAN_BATCH):
        rkey = raw.decode() if isinstance(raw, bytes) else raw
        segments.setdefault(key_of_redis_name(rkey), []).append(rkey)
    keys = list(segments)
    for start in range(0, len(keys), SCAN_BATCH):
        batch = keys[start:start + SCAN_BATCH]
        pipe = client.pipeline(transaction=False)
        for key in batch:
            for rkey in segments[key]:
                pipe.strlen(rkey)
        sizes = iter(pipe.execute(raise_on_error=False))
        for key in batch:
            lengths = [next(sizes) for _ in segments[key]]
            if any(isinstance(n, Exception) for n in lengths):
                denied += 1
                continue
            yield Entry(REDIS, key, sum(lengths), tuple(segments[key]))
    if denied:
        logger.warning("kvtier: %d records in namespace %r could not be read (ACL: NOPERM, "
                       "or gone); skipped", denied, namespace)


def _redis_delete(config: Config, keys: list[str]) -> None:
    router = _router(config)
    try:
        by_node: dict[int, tuple[object, list[str]]] = {}
        for rkey in keys:  # a chunk's segments share a hash tag: one node
            client = router.node_for(rkey)
            by_node.setdefault(id(client), (client, []))[1].append(rkey)
        for client, node_keys in by_node.values():
            for start in range(0, len(node_keys), SCAN_BATCH):
                # One DEL per key: a cluster refuses a DEL whose keys span slots.
                pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
                for rkey in node_keys[start:start + SCAN_BATCH]:
                    pipe.delete(rkey)
                pipe.execute()
    finally:
        router.close()
