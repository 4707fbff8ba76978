"""Write-around: the chunks the CPU tier's admission refused still reach the lower tiers.

Admission (`admission_policy`, `kvtier.storage.admission`) decides what the CPU tier spends its
room on. The lower tiers are another matter: they are larger, and a Redis tier is read by every
server sharing it, so a prompt this server saw once may be the one another server is asked for
next (a conversation's next turn routed elsewhere). So the chunks a store was refused are
copied into a buffer of their own and handed to the lower tiers' writers only (whatever the
write policy); each chunk's memory is released once every tier has written it.

The buffer is not the arena: room made there is made by evicting, the cost admission refused
to pay. It is `AROUND_FRACTION` of the arena (at least `MIN_CHUNKS` full chunks, at most
`MAX_BYTES`), allocated when the engine starts with an admission policy other than `always`.
While it is full (the writers lag behind), a refused chunk reaches no tier, counted in
`write_around_no_memory`; `written_around` counts the chunks handed down.
"""

from __future__ import annotations

from kvtier.config.names import ALWAYS
from kvtier.memory import ALIGN, KVLayout, MemoryAllocator
from kvtier.storage import StorageManager

__all__ = ["AROUND_FRACTION", "MIN_CHUNKS", "MAX_BYTES", "around_buffer"]

AROUND_FRACTION = 1 / 16  # of the arena: the refused chunks in flight to the lower tiers
MIN_CHUNKS = 4
MAX_BYTES = 256 << 20


def around_buffer(storage: StorageManager, layout: KVLayout, write_down: bool,
                  ) -> MemoryAllocator | None:
    """The write-around buffer for an engine on `storage`, or None where nothing is refused
    (`admission_policy: always`) or this engine writes nothing down (see the module
    docstring). Declares its counters."""
    config = storage.config
    if not write_down or config.admission_policy == ALWAYS or not storage.hot.keeps_puts:
        return None
    storage.counters.declare("written_around", "write_around_no_memory")
    chunk = -(-layout.nbytes(config.chunk_size) // ALIGN) * ALIGN
    size = max(int(storage.allocator.size * AROUND_FRACTION), MIN_CHUNKS * chunk)
    return MemoryAllocator(max(ALIGN, min(size, max(MAX_BYTES, chunk))))
