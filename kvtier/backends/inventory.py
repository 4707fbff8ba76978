"""What a persistent tier holds, seen from its config alone with no server running
(`kvtier ls`, `stats`, `purge`): its records (`StoredRecord`), a tier's `RecordInventory` that
lists and deletes them, and what it holds summed up (`InventorySummary`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.keys import KeySpace, model_name_of

if TYPE_CHECKING:  # annotations only: the inventories' contract does not import the loader
    from kvtier.config import Config

__all__ = ["InventorySummary", "RecordInventory", "StoredRecord"]


@dataclass(frozen=True)
class StoredRecord:
    """One stored chunk as an inventory sees it: its tier, key string, size in bytes and where
    it lives (a path; a record's Redis names)."""

    tier: str
    key: str
    nbytes: int
    location: tuple[str, ...]

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
class InventorySummary:
    """What one tier holds in a namespace: its records, their bytes, and the models (as
    served) they belong to, sorted."""

    records: int
    nbytes: int
    models: tuple[str, ...]


class RecordInventory(ABC):
    """What a persistent tier holds, listed and deleted from its config alone, with no server
    running (`kvtier ls`, `stats`, `purge`); a tier's table row names its inventory class.

    Construction and calls raise when the tier cannot be reached (the caller reports that
    tier as down and goes on with the others); `ConfigError` when the config names a place
    the tier would refuse.
    """

    def __init__(self, config: Config):
        self.config = config

    @classmethod
    def peek(cls, config: Config) -> dict[str, float] | None:
        """What the tier holds (`entries`, `bytes`, `capacity_bytes`), read without changing
        anything where opening the tier would (`kvtier info` on a serving host); `OSError`
        saying why the tier could not be used. None: ask the opened tier instead (its
        start-up changes nothing)."""
        return None

    @abstractmethod
    def records(self, namespace: str) -> Iterator[StoredRecord]:
        """The records of `namespace` (and records whose namespace cannot be read, such as
        corrupt ones), never another namespace's."""

    @abstractmethod
    def delete(self, records: Sequence[StoredRecord]) -> list[StoredRecord]:
        """Delete `records` (as listed by `records`); returns those deleted (one gone
        meanwhile, or no longer a record of this tier, is left out)."""

    def summary(self) -> InventorySummary:
        """What the tier holds in the config's namespace (`kvtier stats`), records whose
        namespace cannot be read (corrupt ones) included, as `records` lists them."""
        records = nbytes = 0
        models: set[str] = set()
        for record in self._own():
            records += 1
            nbytes += record.nbytes
            models.add(record.model)
        return InventorySummary(records, nbytes, tuple(sorted(models)))

    def delete_model(self, model: str) -> list[StoredRecord]:
        """Delete the records of `model` (its name as served) in the config's namespace;
        returns those deleted (`delete`'s answer: none when the tier holds none of it).

        Raises:
            ValueError: `model` is empty (it would name no model; purge all with `delete`).
        """
        if not model:
            raise ValueError("model: give the model's name as served; an empty name names "
                             "no model")
        found = [record for record in self._own() if record.model == model]
        return self.delete(found) if found else []

    def _own(self) -> Iterator[StoredRecord]:
        """`records` of the config's namespace, any other a tier lists left out."""
        namespace = self.config.key_namespace
        return (r for r in self.records(namespace) if r.namespace in (namespace, None))

    def close(self) -> None:  # noqa: B027 - most inventories hold nothing to release
        """Release connections; idempotent."""
