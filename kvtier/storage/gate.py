"""Open until closed, and closing waits for the calls already inside."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Gate"]


class Gate:
    """Calls enter through `enter()`; `close()` refuses new ones and waits for those inside.
    Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._inside = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def enter(self) -> Iterator[bool]:
        """Whether the gate is open; if so, `close()` waits for the block to end."""
        with self._cond:
            open_ = not self._closed
            if open_:
                self._inside += 1
        try:
            yield open_
        finally:
            if open_:
                with self._cond:
                    self._inside -= 1
                    if not self._inside:
                        self._cond.notify_all()

    def close(self, timeout: float) -> int | None:
        """Refuse new calls, then wait up to `timeout` seconds for those inside. Returns how
        many are still inside after that (0 when all left), or None if already closed."""
        with self._cond:
            if self._closed:
                return None
            self._closed = True
            self._cond.wait_for(lambda: not self._inside, timeout)
            return self._inside
