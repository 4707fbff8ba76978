"""Every rank's side of kvtier's admin ops: one operation applied to this TP rank's kvtier, on
the scheduler thread, answered as JSON (`apply`).

Every scheduler (one per TP rank) is reached through SGLang's HiCache attach channel: the
plugin wraps the scheduler's handler (`wrap_attach`, `wrap_detach`), which for a kvtier tree
applies the operation to kvtier's engine and answers with JSON; other trees get SGLang's own
handler. The HTTP side that sends them is `routes.py`. Unlike HiCache's attach, kvtier's works
while requests run: stores and loads go on, a detached tier's queued writes are written (or
dropped with `drain: false`) and its reads finish before it is closed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier.config.schema import VERIFY_SCOPES
from kvtier.config.tiers import lower_tier_names
from kvtier.engine.tenants import forget_tenant, tag_of_tenant
from kvtier.errors import ConfigError
from kvtier.integration.sglang.admin.attach import attach_config
from kvtier.integration.sglang.admin.tp_answers import gather_ranks
from kvtier.integration.sglang.boundary.sglang_views import (
    SchedulerView,
    StorageReqInputView,
    StorageReqOutputView,
)
from kvtier.keys import TAG_PREFIX

if TYPE_CHECKING:
    from kvtier.engine import CacheEngine
    from kvtier.integration.sglang.rank.adapter import SGLangKVTier

__all__ = ["JsonObject", "apply", "wrap_attach", "wrap_detach"]

logger = logging.getLogger(__name__)

# A JSON object as HTTP and the ranks' channel carry it (a request, a rank's answer): its values
# are whatever JSON decodes to, each checked where it is read.
JsonObject = dict[str, Any]


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
