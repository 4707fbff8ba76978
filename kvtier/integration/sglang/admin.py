"""kvtier's tiers attached and detached on a running SGLang server, over its own HTTP port.

    GET  /kvtier/tiers   the attached tiers and session pins, per TP rank
    POST /kvtier/tiers   {"op": "attach", "tier": "redis", "config": {"remote_url": "..."}}
                         {"op": "detach", "tier": "redis", "drain": true}

SGLang's own `PUT /hicache/storage-backend` (`hicache_storage_backend`: `disk` or `redis`, the
tier's keys as `hicache_storage_backend_extra_config_json`) attaches a tier too, and
`DELETE /hicache/storage-backend` detaches every lower tier. Changing tiers needs SGLang's
`--admin-api-key` (the POST is refused with 403 on a server started without one, and with 401
without the admin key: an inference client's `--api-key` is not enough); listing them is open
at SGLang's optional-admin level.

Every scheduler (one per TP rank) is reached through SGLang's HiCache attach channel: the
plugin wraps the scheduler's handler, which for a kvtier tree applies the operation to kvtier's
engine and answers with JSON; other trees get SGLang's own handler. Unlike HiCache's attach,
kvtier's works while requests run: stores and loads go on, a detached tier's queued writes
are written (or dropped with `drain: false`) and its reads finish before it is closed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from kvtier.config import with_overrides
from kvtier.errors import ConfigError

__all__ = ["apply", "add_routes", "wrap_attach", "wrap_detach"]

logger = logging.getLogger(__name__)

LOWER_TIERS = ("disk", "redis")


def apply(kvtier: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Run one admin operation on this rank's kvtier; returns the rank's JSON answer.

    Raises:
        ValueError / ConfigError: a bad operation, tier name or config key (the answer to the
            caller names it).
    """
    engine = kvtier.engine
    op = request.get("op", "list")
    if op == "attach":
        name = _tier_name(request)
        overrides = request.get("config") or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"config: must be an object of kvtier keys, got {overrides!r}")
        engine.attach_tier(name, with_overrides(engine.config, overrides, "attach config"))
    elif op == "detach":
        # Unpublished at once; its writes drain and its reads finish on another thread, so
        # the scheduler does not wait for them.
        engine.detach_tier(_tier_name(request), drain=bool(request.get("drain", True)),
                           wait=False)
    elif op != "list":
        raise ValueError(f"op: must be list, attach or detach, got {op!r}")
    stats = engine.stats()
    return {"tiers": [t.name for t in engine.storage.tiers],
            "sessions_pinned": stats.get("sessions_pinned", 0),
            "session_pinned_bytes": stats.get("session_pinned_bytes", 0)}


def _tier_name(request: dict[str, Any]) -> str:
    name = request.get("tier")
    if name not in LOWER_TIERS:
        raise ValueError(f"tier: must be one of {list(LOWER_TIERS)}, got {name!r}")
    return str(name)


def _answer(kvtier: Any, request: dict[str, Any]) -> tuple[bool, str]:
    try:
        return True, json.dumps(apply(kvtier, request))
    except (ValueError, ConfigError, TypeError) as exc:
        return False, json.dumps({"error": str(exc)})


def wrap_attach(original: Callable[..., Any], scheduler: Any, recv_req: Any) -> Any:
    """AROUND `Scheduler.attach_hicache_storage_wrapped`: kvtier trees answer themselves."""
    kvtier = getattr(scheduler.tree_cache, "kvtier", None)
    if kvtier is None:
        return original(scheduler, recv_req)
    from sglang.srt.managers.io_struct import AttachHiCacheStorageReqOutput

    backend = recv_req.hicache_storage_backend
    try:
        extra = json.loads(recv_req.hicache_storage_backend_extra_config_json or "{}")
    except json.JSONDecodeError as exc:
        return AttachHiCacheStorageReqOutput(success=False, message=json.dumps(
            {"error": f"hicache_storage_backend_extra_config_json: not JSON: {exc}"}))
    request = extra if backend == "kvtier" else {"op": "attach", "tier": backend,
                                                 "config": extra}
    ok, message = _answer(kvtier, request)
    return AttachHiCacheStorageReqOutput(success=ok, message=message)


def wrap_detach(original: Callable[..., Any], scheduler: Any, recv_req: Any) -> Any:
    """AROUND `Scheduler.detach_hicache_storage_wrapped`: detach every lower kvtier tier."""
    kvtier = getattr(scheduler.tree_cache, "kvtier", None)
    if kvtier is None:
        return original(scheduler, recv_req)
    from sglang.srt.managers.io_struct import DetachHiCacheStorageReqOutput

    ok, message = True, ""
    for tier in [t.name for t in kvtier.engine.storage.tiers if t.name in LOWER_TIERS]:
        ok, message = _answer(kvtier, {"op": "detach", "tier": tier})
    if not message:
        message = json.dumps(apply(kvtier, {"op": "list"}))
    return DetachHiCacheStorageReqOutput(success=ok, message=message)


def add_routes(app: Any) -> None:
    """Add `GET/POST /kvtier/tiers` to SGLang's HTTP app (launcher process). Idempotent."""
    if any(getattr(r, "path", None) == "/kvtier/tiers" for r in app.routes):
        return
    from fastapi import Body
    from fastapi.responses import JSONResponse
    from sglang.srt.managers.io_struct import AttachHiCacheStorageReqInput
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def run(request: dict[str, Any]) -> JSONResponse:
        from sglang.srt.entrypoints import http_server

        manager = http_server._global_state.tokenizer_manager
        manager.auto_create_handle_loop()
        # The communicator directly: the tokenizer's own attach would record "kvtier" as
        # the server's HiCache backend.
        results = await manager.attach_hicache_storage_communicator(
            AttachHiCacheStorageReqInput(hicache_storage_backend="kvtier",
                                         hicache_storage_backend_extra_config_json=json.dumps(
                                             request)))
        ranks = [json.loads(r.message) for r in results]
        ok = all(r.success for r in results)
        return JSONResponse({"success": ok, "ranks": ranks}, status_code=200 if ok else 400)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def list_tiers() -> JSONResponse:
        return await run({"op": "list"})

    # Attaching a tier decides where every later prompt goes: never without the admin key.
    @auth_level(AuthLevel.ADMIN_FORCE)
    async def change_tiers(body: dict[str, Any] = Body(...)) -> JSONResponse:  # noqa: B008
        return await run(body)

    app.add_api_route("/kvtier/tiers", list_tiers, methods=["GET"])
    app.add_api_route("/kvtier/tiers", change_tiers, methods=["POST"])
