"""What the persistent tiers of a config hold, per model and layout; and deleting it.

Keys name their namespace, model and layout
(`kvtier/v2/{namespace}/{model}@{fingerprint}/{layout}/{rank}of{world}/{digest}`), so every
tier with a `RecordInventory` (its table row's `inventory`: disk, Redis) can be listed without
a running engine. Used by `kvtier stats | ls | purge` (through each inventory's `summary`,
`records`, `delete_model` and `delete`); a tier that cannot be reached is one row saying why,
and the others are still listed and purged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from kvtier.backends import InventorySummary, RecordInventory, StoredRecord, check_dependencies
from kvtier.config import Config
from kvtier.config.tiers import load_attr, tier_spec
from kvtier.errors import ConfigError
from kvtier.keys import tag_of_key

__all__ = ["Group", "Listing", "Summary", "purge", "summarize", "survey"]

T = TypeVar("T")


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
    """What one persistent tier holds, or why it could not be listed (`error`: the tier is
    down or refuses kvtier; its groups are then empty)."""

    tier: str
    groups: list[Group]
    error: str | None = None


@dataclass(frozen=True)
class Summary:
    """What one persistent tier holds in the config's namespace (`held`), or why it could not
    be counted (`error`: `held` is then None)."""

    tier: str
    held: InventorySummary | None
    error: str | None = None


def summarize(config: Config) -> list[Summary]:
    """One `Summary` per persistent tier of the config, in tier order (`kvtier stats`); a
    tier that cannot be reached is one with its `error`. `ConfigError` as for `survey`."""
    return [Summary(tier, held, error)
            for tier, held, error in _each_tier(config, lambda inv: inv.summary())]


def survey(config: Config, model: str | None = None, tag: str | None = None) -> list[Listing]:
    """One `Listing` per persistent tier of the config, in tier order: a tier that cannot be
    reached is a listing with its `error`, so the others are still shown. `ConfigError`
    (a `local_disk` the tier would refuse) is raised: it is the config's fault, not the
    tier's state. `model`, `tag`: only that model's records, only the records of the tenant
    with that tag (`kvtier.keys.tenant_tag`)."""
    def listed(inventory: RecordInventory) -> list[StoredRecord]:
        namespace = config.key_namespace
        return list(_select(inventory.records(namespace), namespace, model, tag))

    return [Listing(tier, _sum(iter(found or [])), error)
            for tier, found, error in _each_tier(config, listed)]


def purge(config: Config, model: str | None = None, tag: str | None = None) -> list[Listing]:
    """Delete what `survey` lists; one `Listing` per tier of what was deleted, or of why
    nothing could be (a tier that is down is reported, the others are still purged).

    Raises:
        ValueError: `model` is empty (it names no model).
    """
    if model is not None and not model:
        raise ValueError("model: give the model's name as served; an empty name names no "
                         "model")

    def deleted(inventory: RecordInventory) -> list[StoredRecord]:
        if model is not None and tag is None:
            return inventory.delete_model(model)
        namespace = config.key_namespace
        found = list(_select(inventory.records(namespace), namespace, model, tag))
        return inventory.delete(found) if found else found

    return [Listing(tier, _sum(iter(gone or [])), error)
            for tier, gone, error in _each_tier(config, deleted)]


def _each_tier(config: Config, act: Callable[[RecordInventory], T],
               ) -> Iterator[tuple[str, T | None, str | None]]:
    """`act` on each persistent tier's inventory, in tier order: (tier, its answer, None),
    or (tier, None, why) for a tier that is down or refuses kvtier."""
    for tier in config.tiers:
        spec = tier_spec(tier)
        if not spec.inventory:
            continue  # in a server's memory: nothing to list from here
        try:
            check_dependencies(tier)
            inventory: RecordInventory = load_attr(spec.inventory)(config)
        except ConfigError:
            raise
        except Exception as exc:  # a down or refusing tier is a row, never the command's end
            yield tier, None, _reason(exc)
            continue
        try:
            yield tier, act(inventory), None
        except ConfigError:
            raise
        except Exception as exc:
            yield tier, None, _reason(exc)
        finally:
            inventory.close()


def _reason(exc: Exception) -> str:
    if type(exc).__module__.startswith("redis"):
        return f"unreachable: {str(exc) or type(exc).__name__}"
    return str(exc) or type(exc).__name__


def _select(found: Iterator[StoredRecord], namespace: str, model: str | None,
            tag: str | None) -> Iterator[StoredRecord]:
    return (e for e in found if e.namespace in (namespace, None)
            and (model is None or e.model == model)
            and (tag is None or tag_of_key(e.key) == tag))


def _sum(found: Iterator[StoredRecord]) -> list[Group]:
    sums: dict[tuple[str, str, str], list[int]] = {}
    for e in found:
        total = sums.setdefault((e.tier, e.model, e.layout), [0, 0])
        total[0] += 1
        total[1] += e.nbytes
    out = [Group(t, m, lay, c, b) for (t, m, lay), (c, b) in sums.items()]
    return sorted(out, key=lambda g: (-g.nbytes, g.tier, g.model))
