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

Every scheduler (one per TP rank) is reached through SGLang's HiCache attach channel: the
plugin wraps the scheduler's handler, which for a kvtier tree applies the operation to kvtier's
engine and answers with JSON; other trees get SGLang's own handler. Unlike HiCache's attach,
kvtier's works while requests run: stores and loads go on, a detached tier's queued writes
are written (or dropped with `drain: false`) and its reads finish before it is closed.
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

from kvtier.config.schema import VERIFY_SCOPES
from kvtier.config.tiers import lower_tier_names
from kvtier.engine.tenants import forget_tenant, tag_of_tenant
from kvtier.errors import ConfigError
from kvtier.integration.sglang.admin.attach import MAX_TIMEOUT_S, attach_config
from kvtier.integration.sglang.admin.tp_answers import gather_ranks
from kvtier.integration.sglang.boundary.sglang_api import tokenizer_manager
from kvtier.integration.sglang.boundary.sglang_views import (
    SchedulerView,
    StorageReqInputView,
    StorageReqOutputView,
)
from kvtier.keys import TAG_PREFIX

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvtier.engine import CacheEngine
    from kvtier.integration.sglang.rank.adapter import SGLangKVTier

__all__ = ["apply", "add_routes", "wrap_attach", "wrap_detach"]

logger = logging.getLogger(__name__)

# The HTTP side gives every rank this long to build a tier (connect timeout, one retry, and
# a disk index) before it aborts the attach everywhere.
ATTACH_DEADLINE_S = 3 * MAX_TIMEOUT_S + 30.0
POLL_S = 0.1
KEEP_OPERATIONS = 16

# A JSON object as HTTP and the ranks' channel carry it (a request, a rank's answer): its values
# are whatever JSON decodes to, each checked where it is read.
JsonObject = dict[str, Any]


class AttachOp(TypedDict):
    """One attach as `GET /kvtier/tiers` reports it."""

    id: str
    op: str
    tier: str
    state: str  # building, then attached or failed
    errors: list[str]


def apply(kvtier: SGLangKVTier, request: JsonObject) -> JsonObject:
    """Run one admin operation on this rank's kvtier (scheduler thread; never waits for a
    tier build); returns the rank's JSON answer.

    Ops: `list`; `attach` (start building, `commit` when built: see `attach.py`); `commit`,
    `abort` (the second phase); `detach`; `verify`; `purge` (one tenant: its answer adds
    `purged`, the tenant's tag and the chunks each tier deleted).

    Raises:
        ValueError / ConfigError: a bad operation, tier name or config key (the answer to the
            caller names it).
    """
    engine = kvtier.engine
    op = request.get("op", "list")
    if op in ("attach", "commit", "abort", "detach"):
        name = _tier_name(request)
    if op == "attach":
        config = attach_config(engine.config, name, request.get("config") or {})
        kvtier.attachments.start(name, config, commit=bool(request.get("commit", False)))
    elif op == "commit":
        kvtier.attachments.commit(name)
    elif op == "abort":
        kvtier.attachments.abort(name)
    elif op == "detach":
        # Unpublished at once; its writes drain and its reads finish on another thread, so
        # the scheduler does not wait for them.
        engine.tiers.detach(name, drain=bool(request.get("drain", True)), wait=False)
    elif op == "verify":
        _set_verification(engine, request)
    elif op == "purge":
        purged = _purge(engine, request)
    elif op != "list":
        raise ValueError(f"op: must be list, attach, detach, verify or purge, got {op!r}")
    stats = engine.stats()
    answer = {"tiers": engine.tiers.names,
            "attaching": kvtier.attachments.states(),
            "sessions_pinned": stats.get("sessions_pinned", 0),
            "session_pinned_bytes": stats.get("session_pinned_bytes", 0),
            "verify_fraction": engine.verify_fraction,
            "verify_scope": engine.verify_scope,
            "verified": {tier: {"checked": stats.get(f"{tier}.verify_checked", 0),
                                "mismatched": stats.get(f"{tier}.verify_mismatch", 0)}
                         for tier in engine.tiers.names}}
    return answer if op != "purge" else {**answer, "purged": purged}


def _purge(engine: CacheEngine, request: JsonObject) -> JsonObject:
    """The `purge` op: tenant `tenant` (a salt) forgotten by this rank's engine; the answer
    names it by its keyed tag, never by the salt (`kvtier.engine.tenants`)."""
    salt = request.get("tenant")
    if not isinstance(salt, str):
        raise ValueError("tenant: a purge op needs the tenant's salt (a request's "
                         "cache_salt) as a string")
    counts = forget_tenant(engine, salt)
    return {"tenant": TAG_PREFIX + tag_of_tenant(engine, salt), "chunks": counts}


def _set_verification(engine: CacheEngine, request: JsonObject) -> None:
    """The `verify` op: a new `fraction`, `scope` or both, each checked before either is set."""
    if "fraction" not in request and "scope" not in request:
        raise ValueError("fraction: a verify op needs a fraction, a scope or both")
    fraction = _fraction(request) if "fraction" in request else engine.verify_fraction
    scope = request.get("scope", engine.verify_scope)
    if scope not in VERIFY_SCOPES:
        raise ValueError(f"scope: must be one of {', '.join(VERIFY_SCOPES)}, got {scope!r}")
    engine.verify_fraction, engine.verify_scope = fraction, scope
    logger.info("kvtier: verify_fraction %g, verify_scope %s (set over HTTP)", fraction, scope)


def _fraction(request: JsonObject) -> float:
    value = request.get("fraction")
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"fraction: must be a number in [0, 1], got {value!r}")
    return float(value)


def _tier_name(request: JsonObject) -> str:
    name = request.get("tier")
    if name not in lower_tier_names():
        raise ValueError(f"tier: must be one of {lower_tier_names()}, got {name!r}")
    return str(name)


def _answer(kvtier: SGLangKVTier, request: JsonObject, *,
            every: bool = False) -> tuple[bool, str]:
    """(succeeded, JSON answer); `every`: any exception is an answer (the op's ranks meet in
    a gather next, which a rank raising past it would leave waiting forever)."""
    try:
        return True, json.dumps(apply(kvtier, request))
    except (ValueError, ConfigError, TypeError) as exc:
        return False, json.dumps({"error": str(exc)})
    except Exception as exc:
        if not every:
            raise
        logger.warning("kvtier: admin op %s failed: %r", request.get("op"), exc)
        return False, json.dumps({"error": f"{type(exc).__name__}: {exc}"})


def wrap_attach(original: Callable[..., StorageReqOutputView], scheduler: SchedulerView,
                recv_req: StorageReqInputView) -> StorageReqOutputView:
    """AROUND `Scheduler.attach_hicache_storage_wrapped`: kvtier trees answer themselves."""
    kvtier: SGLangKVTier | None = getattr(scheduler.tree_cache, "kvtier", None)
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
                                                 "config": extra, "commit": True}
    if request.get("op") == "purge":  # every TP rank's counts, in TP rank 0's reply
        ok, message = gather_ranks(scheduler, *_answer(kvtier, request, every=True), "purged")
    else:
        ok, message = _answer(kvtier, request)
    return AttachHiCacheStorageReqOutput(success=ok, message=message)


def wrap_detach(original: Callable[..., StorageReqOutputView], scheduler: SchedulerView,
                recv_req: object) -> StorageReqOutputView:
    """AROUND `Scheduler.detach_hicache_storage_wrapped`: detach every lower kvtier tier."""
    kvtier: SGLangKVTier | None = getattr(scheduler.tree_cache, "kvtier", None)
    if kvtier is None:
        return original(scheduler, recv_req)
    from sglang.srt.managers.io_struct import DetachHiCacheStorageReqOutput

    ok, message = True, ""
    for tier in [t for t in kvtier.engine.tiers.names if t in lower_tier_names()]:
        ok, message = _answer(kvtier, {"op": "detach", "tier": tier})
    if not message:
        message = json.dumps(apply(kvtier, {"op": "list"}))
    return DetachHiCacheStorageReqOutput(success=ok, message=message)


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
