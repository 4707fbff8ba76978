"""kvtier's tiers attached and detached on a running SGLang server, over its own HTTP port.

    GET  /kvtier/tiers   the attached tiers and session pins per TP rank, and recent attaches
    POST /kvtier/tiers   {"op": "attach", "tier": "redis", "config": {"remote_timeout_secs": 3}}
                         {"op": "detach", "tier": "redis", "drain": true}
                         {"op": "verify", "fraction": 0.01, "scope": "tail"}
                                        (shadow verification's share and scope; either key)
                         {"op": "purge", "tenant": "SALT"}
                                        (forget one tenant: `kvtier.engine.tenants`)

An attach answers 202 with an id at once and runs in the background (`attach.py`): every rank
builds the tier on a thread of its own, then the tier is published on every rank, or on none
if one rank failed; `GET /kvtier/tiers` shows how it went (`kvtier tiers attach` waits for
it). Only tiers the server's config declares can be attached, from that config. A detach
answers once every rank unpublished the tier; its writes drain on a background thread.

SGLang's own `PUT /hicache/storage-backend` (`hicache_storage_backend`: `disk` or `redis`, the
overrides as `hicache_storage_backend_extra_config_json`) starts an attach on each rank that
publishes as soon as that rank built the tier, and `DELETE /hicache/storage-backend` detaches
every lower tier. Changing tiers needs SGLang's `--admin-api-key` (the POST is refused with 403
on a server started without one, and with 401 without the admin key: an inference client's
`--api-key` is not enough); listing them is open at SGLang's optional-admin level.

Every op reaches each rank's scheduler through SGLang's HiCache attach channel; each rank
applies it and answers (`ops.py`).
"""


from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypedDict

from kvtier.integration.sglang.admin.attach import MAX_TIMEOUT_S
from kvtier.integration.sglang.admin.ops import JsonObject
from kvtier.integration.sglang.boundary.sglang_api import tokenizer_manager

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["add_routes"]

logger = logging.getLogger(__name__)


# The HTTP side gives every rank this long to build a tier (connect timeout, one retry, and
# a disk index) before it aborts the attach everywhere.
ATTACH_DEADLINE_S = 3 * MAX_TIMEOUT_S + 30.0
POLL_S = 0.1
KEEP_OPERATIONS = 16


class AttachOp(TypedDict):
    """One attach as `GET /kvtier/tiers` reports it."""

    id: str
    op: str
    tier: str
    state: str  # building, then attached or failed
    errors: list[str]


class _Operations:
    """The launcher's record of recent attaches (what `GET /kvtier/tiers` reports)."""

    def __init__(self) -> None:
        self._ops: OrderedDict[str, AttachOp] = OrderedDict()

    def new(self, tier: str) -> AttachOp:
        op: AttachOp = {"id": uuid.uuid4().hex[:12], "op": "attach", "tier": tier,
                        "state": "building", "errors": []}
        self._ops[op["id"]] = op
        while len(self._ops) > KEEP_OPERATIONS:
            self._ops.popitem(last=False)
        return op

    def recent(self) -> list[AttachOp]:
        return list(self._ops.values())


_OPERATIONS = _Operations()
_TASKS: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks
Send = Callable[[JsonObject], Awaitable[tuple[bool, list[JsonObject]]]]


async def _finish_attach(send: Send, op: AttachOp) -> None:
    """Wait for every rank to build `op`'s tier, then commit it on all of them, or abort it on
    all of them if one failed or the deadline passed."""
    try:
        await _settle_attach(send, op)
    except Exception as exc:  # the caller polls for an end: never leave it "building"
        op["state"], op["errors"] = "failed", [f"kvtier: {type(exc).__name__}: {exc}"]
        logger.warning("kvtier: attach of tier %s failed: %r", op["tier"], exc)


async def _settle_attach(send: Send, op: AttachOp) -> None:
    tier = op["tier"]
    deadline = time.monotonic() + ATTACH_DEADLINE_S
    while True:
        await asyncio.sleep(POLL_S)
        _, ranks = await send({"op": "list"})
        states = [r.get("attaching", {}).get(tier, {"state": "gone", "error": "aborted"})
                  for r in ranks]
        failed = [f"rank {i}: {s['error'] or s['state']}" for i, s in enumerate(states)
                  if s["state"] not in ("building", "built")]
        if not failed and all(s["state"] == "built" for s in states):
            ok, ranks = await send({"op": "commit", "tier": tier})
            if ok:
                op["state"] = "attached"
                return
            failed = [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if "error" in r]
            await send({"op": "detach", "tier": tier, "drain": False})
        elif not failed and time.monotonic() > deadline:
            failed = [f"not built on every rank within {ATTACH_DEADLINE_S:g}s"]
        if failed:
            await send({"op": "abort", "tier": tier})
            op["state"], op["errors"] = "failed", failed
            logger.warning("kvtier: attach of tier %s failed: %s", tier, "; ".join(failed))
            return


def add_routes(app: FastAPI) -> None:
    """Add `GET/POST /kvtier/tiers` to SGLang's HTTP app (launcher process). Idempotent."""
    if any(getattr(r, "path", None) == "/kvtier/tiers" for r in app.routes):
        return
    from fastapi import Body
    from fastapi.responses import JSONResponse
    from sglang.srt.managers.io_struct import AttachHiCacheStorageReqInput
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def send(request: JsonObject) -> tuple[bool, list[JsonObject]]:
        """`request` to every rank's scheduler; (all succeeded, each rank's answer)."""
        manager = tokenizer_manager()
        manager.auto_create_handle_loop()
        # The communicator directly: the tokenizer's own attach would record "kvtier" as
        # the server's HiCache backend.
        results = await manager.attach_hicache_storage_communicator(
            AttachHiCacheStorageReqInput(hicache_storage_backend="kvtier",
                                         hicache_storage_backend_extra_config_json=json.dumps(
                                             request)))
        return all(r.success for r in results), [json.loads(r.message) for r in results]

    async def run(request: JsonObject) -> JSONResponse:
        if request.get("op") in ("commit", "abort"):
            return JSONResponse({"success": False, "error": "op: commit and abort are "
                                 "kvtier's own second phase of an attach"}, status_code=400)
        if request.get("op") != "attach":
            ok, ranks = await send(request)
            return JSONResponse({"success": ok, "ranks": ranks,
                                 "operations": _OPERATIONS.recent()},
                                status_code=200 if ok else 400)
        request = {**request, "commit": False}
        ok, ranks = await send(request)
        if not ok:  # refused by a rank (bad key, undeclared tier): undo where it started
            await send({"op": "abort", "tier": request.get("tier")})
            return JSONResponse({"success": False, "ranks": ranks}, status_code=400)
        op = _OPERATIONS.new(str(request["tier"]))
        task = asyncio.get_running_loop().create_task(_finish_attach(send, op))
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)
        return JSONResponse({"success": True, "operation": op, "ranks": ranks},
                            status_code=202)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def list_tiers() -> JSONResponse:
        return await run({"op": "list"})

    # Attaching a tier decides where every later prompt goes: never without the admin key.
    @auth_level(AuthLevel.ADMIN_FORCE)
    async def change_tiers(body: dict[str, Any] = Body(...)) -> JSONResponse:  # noqa: B008
        return await run(body)

    app.add_api_route("/kvtier/tiers", list_tiers, methods=["GET"])
    app.add_api_route("/kvtier/tiers", change_tiers, methods=["POST"])
