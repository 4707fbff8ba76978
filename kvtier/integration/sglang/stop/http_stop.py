"""The launcher's HTTP side of a stop: a bounded grace, then every request still running ends
with an error its client can read.

uvicorn's graceful shutdown waits, with no bound, until every response has ended; kvtier gives
it `GRACE_S` from the first signal (`bound_http_grace`). When the grace ran out, uvicorn used
to cancel the responses still streaming: the client saw its stream end with neither
`data: [DONE]` nor an error, as if the answer were complete, and the scheduler never heard of
it, so the prompt it had prefilled was freed with the process. Now, shortly before the grace
runs out (`CUT_BEFORE_S`), each request still running (`generate_request`, which serves
/generate and the OpenAI routes) is aborted in the scheduler and raises `ServerStopping` (a
`ValueError` whose `status_code` is 503) naming the stop: SGLang answers it as it answers a
bad request, with a last event `data: {"error": {"message": "server stopping (SIGINT): ...",
"code": 503, ...}}` then `data: [DONE]` on a stream, or an HTTP 503 error response. The
scheduler finishes the aborted request, its prefilled KV goes into the tree and kvtier stores
it (`KVTierRadixCache.checkpoint`), and the scheduler's drain writes it down (shutdown.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

from kvtier.integration.sglang.stop import shutdown

__all__ = ["CUT_BEFORE_S", "ServerStopping", "bound_http_grace", "cut_requests_at_stop",
           "install"]

logger = logging.getLogger("kvtier.integration.sglang.stop.shutdown")  # one logger: one stop

# Before the grace runs out: SGLang's streaming response runs a background task 2 s after its
# last event (`create_abort_task`), and the response ends only after it.
CUT_BEFORE_S = 2.5
_CUT = "kvtier: the server's stop"  # the cancel message of a request kvtier cuts


class ServerStopping(ValueError):
    """A request the server's stop cut. A `ValueError`: SGLang's routes turn one into an error
    response (an error event on a stream) with its `status_code`."""

    status_code = 503


class _Running:
    """A request in `generate_request`: its ids, and whether it awaits SGLang's next output
    (then the cut cancels that wait) or is elsewhere (then it stops before its next one)."""

    def __init__(self, rids: list[str]):
        self.rids = rids
        self.awaiting = False
        self.cut = False


class _Stop:
    """What the launcher's event loop knows of a stop (its thread only, but `begin`)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running: dict[asyncio.Task[object], _Running] = {}
        self.message = ""

    def begin(self, sig: int, grace_s: float) -> None:
        """The first signal (a signal handler: the loop is told, never touched)."""
        self.message = (f"server stopping ({signal.Signals(sig).name}): the request was cut "
                        "before it finished; send it again to a running server")
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later,
                                           max(0.0, grace_s - CUT_BEFORE_S), self.cut)

    def cut(self) -> None:
        if not self.running:
            return
        logger.warning("kvtier: the stop ends %d requests still running, each with an error "
                       "(a stream's last event); the scheduler stores what they prefilled",
                       len(self.running))
        for task, request in self.running.items():
            request.cut = True
            if request.awaiting:
                task.cancel(_CUT)


_STOP = _Stop()


def install() -> None:
    """In a launcher whose HTTP server starts (`shutdown.prepare_launcher`): its tokenizer
    manager's requests end with an error at a stop."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    cut_requests_at_stop(TokenizerManager)


def cut_requests_at_stop(manager_class: Any) -> None:
    """Make `manager_class.generate_request` (SGLang's `TokenizerManager`) end with the stop's
    error once `bound_http_grace`'s stop cuts the requests still running. Idempotent."""
    original: Callable[..., AsyncIterator[Any]] = manager_class.generate_request
    if getattr(original, "kvtier", False):
        return

    async def generate_request(self: Any, obj: Any, request: Any = None) -> AsyncIterator[Any]:
        task = asyncio.current_task()
        if task is None:  # not in a task: nothing could cut it
            async for out in original(self, obj, request):
                yield out
            return
        _STOP.loop = asyncio.get_running_loop()
        running = _STOP.running[task] = _Running([])
        outputs = original(self, obj, request).__aiter__()
        try:
            while True:
                if running.cut:
                    raise ServerStopping(_STOP.message)
                running.awaiting = True
                try:
                    out = await outputs.__anext__()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError as exc:
                    if not running.cut or _CUT not in exc.args:
                        raise
                    if hasattr(task, "uncancel"):  # Python 3.11+ counts cancellations
                        task.uncancel()  # kvtier's cut: the response goes on, with the error
                    raise ServerStopping(_STOP.message) from None
                finally:
                    running.awaiting = False
                    running.rids = _rids(obj)
                yield out
        finally:
            _STOP.running.pop(task, None)
            if running.cut:
                for rid in running.rids:
                    self.abort_request(rid)

    generate_request.kvtier = True  # type: ignore[attr-defined]
    manager_class.generate_request = generate_request


def _rids(obj: object) -> list[str]:
    """The request ids of a generate request (one, or a batch's), once SGLang assigned them."""
    rid = getattr(obj, "rid", None)
    if rid is None:
        return []
    return [rid] if isinstance(rid, str) else [r for r in rid if isinstance(r, str)]


def bound_http_grace(server_class: Any) -> None:
    """Give uvicorn's graceful shutdown a bound (`GRACE_S`) from its first signal on, unless
    SGLang set one, and cut the requests still running shortly before it ends (see the module
    docstring). Idempotent; `server_class` is `uvicorn.Server`."""
    original: Callable[..., None] = server_class.handle_exit
    if getattr(original, "kvtier", False):
        return

    def handle_exit(self: Any, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            if self.config.timeout_graceful_shutdown is None:
                self.config.timeout_graceful_shutdown = shutdown.GRACE_S
            logging.getLogger("uvicorn.error").addFilter(_CutAtStop())
            logger.warning("kvtier: %s: no new requests; in-flight requests get %.0f s, then "
                           "kvtier writes what it has queued (up to %.0f s); %s again forces",
                           signal.Signals(sig).name, self.config.timeout_graceful_shutdown,
                           shutdown.DRAIN_S, signal.Signals(sig).name)
            _STOP.begin(sig, float(self.config.timeout_graceful_shutdown))
            if shutdown.is_launcher():
                shutdown.stop_child_watchdog()
        if sig == signal.SIGINT and shutdown.is_launcher():
            # 130 as a shell reports an interrupted program, also where uvicorn does not
            # re-raise the SIGINT it stopped on (a CI run saw it end with status 0)
            shutdown.set_exit_code(130)
        original(self, sig, frame)

    handle_exit.kvtier = True  # type: ignore[attr-defined]
    server_class.handle_exit = handle_exit


class _CutAtStop(logging.Filter):
    """Once a stop has begun, a response uvicorn cancels when the grace runs out is logged as
    one line, not as a 60-line "Exception in ASGI application" traceback of CancelledError."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError) and \
                record.getMessage().strip() == "Exception in ASGI application":
            record.msg = "kvtier: a response still streaming was cut by the stop"
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True
