"""Tier attach on one TP rank, in two phases and off the scheduler thread.

Building a tier connects to Redis or indexes a disk directory: seconds, or as long as a
server that accepts and never answers makes it. The scheduler thread only validates the
request and starts a build thread (`start`); the HTTP side polls every rank (`states`), then
publishes the tier on every rank (`commit`) once all of them built it, or throws every build
away (`abort`) if one failed: attach is all-or-nothing across ranks, and no forward pass
waits for it.

What HTTP may attach is narrow: a tier the server's own config declares (its `local_disk`
or `remote_url`), built from that config, with only the keys its tier table row lists as
`overridable` changed. A
URL or path from the network is refused, and so is a connect timeout past `MAX_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvtier.config import Config, tiers, with_overrides
from kvtier.engine import CacheEngine

__all__ = ["Attachments", "attach_config", "MAX_TIMEOUT_S"]

logger = logging.getLogger(__name__)

MAX_TIMEOUT_S = 10.0  # an attach that cannot connect in this long reports failure


def attach_config(config: Config, tier: str, overrides: object) -> Config:
    """The config an HTTP attach of `tier` builds from: the server's own, with `overrides`.

    Raises:
        ValueError: `tier` is not declared in `config`, `overrides` is not an object, or it
            holds a key `tier` does not take over HTTP (each refused key is named).
        ConfigError: an override's value is invalid.
    """
    attachable = {spec.name: spec for spec in tiers.TABLE if spec.lower and spec.overridable}
    if tier not in attachable:
        raise ValueError(f"tier: must be one of {sorted(attachable)}, got {tier!r}")
    spec = attachable[tier]
    declared = spec.key
    if not spec.enabled(config):
        raise ValueError(f"tier {tier!r} is not declared in this server's kvtier config (no "
                         f"{declared}); HTTP attaches only tiers the config names")
    if not isinstance(overrides, dict):
        raise ValueError(f"config: must be an object of kvtier keys, got "
                         f"{type(overrides).__name__}")
    refused = sorted(set(overrides) - spec.overridable)
    if refused:
        shown = ", ".join(str(k)[:64] for k in refused)
        raise ValueError(f"config: {shown} cannot be set over HTTP for tier {tier!r} (it "
                         f"takes {sorted(spec.overridable)}; its {declared} comes from the "
                         f"server's config)")
    out = with_overrides(config, overrides, "attach config")
    if (problem := tiers.tier_problem(tier, out)) is not None:  # as the launch checks
        raise ValueError(f"config: {problem}")
    if out.remote_timeout_secs > MAX_TIMEOUT_S:
        raise ValueError(f"config: remote_timeout_secs must be at most {MAX_TIMEOUT_S:g} for "
                         f"an attach, got {out.remote_timeout_secs:g}")
    return out


class _Build:
    """One tier being built on a background thread."""

    def __init__(self) -> None:
        self.state = "building"  # then "built" or "failed"
        self.error = ""
        self.built: tuple[Any, Any] | None = None  # (GuardedTier, TierWriter)
        self.aborted = False


class Attachments:
    """This rank's attaches in flight. `start`, `states`, `commit` and `abort` are called on
    the scheduler thread and never wait for a build."""

    def __init__(self, engine: CacheEngine):
        self._engine = engine
        self._lock = threading.Lock()
        self._builds: dict[str, _Build] = {}

    def start(self, tier: str, config: Config, *, commit: bool = False) -> None:
        """Start building `tier` from `config` (see `attach_config`); with `commit`, publish it
        as soon as it is built (no cross-rank agreement: SGLang's own HiCache route).

        Raises:
            ValueError: `tier` is attached or being attached already.
        """
        with self._lock:
            if tier in self._builds or tier in self._engine.tiers.names:
                raise ValueError(f"tier {tier!r} is already attached or being attached")
            build = self._builds[tier] = _Build()
        threading.Thread(target=self._build, args=(tier, config, build, commit),
                         name=f"kvtier-attach-{tier}", daemon=True).start()

    def states(self) -> dict[str, dict[str, str]]:
        """Every attach in flight: {tier: {"state": building|built|failed, "error": ...}}."""
        with self._lock:
            return {name: {"state": b.state, "error": b.error}
                    for name, b in self._builds.items()}

    def commit(self, tier: str) -> None:
        """Publish built `tier`; `ValueError` unless its build succeeded."""
        with self._lock:
            build = self._builds.get(tier)
            if build is None or build.state != "built":
                state = "no attach" if build is None else build.state
                raise ValueError(f"tier {tier!r} cannot be committed: {state}")
            del self._builds[tier]
        assert build.built is not None
        self._engine.tiers.publish(*build.built)

    def abort(self, tier: str) -> None:
        """Give up attaching `tier`: a built tier is closed, one still building is closed when
        its build ends. No attach of `tier`: nothing happens."""
        with self._lock:
            build = self._builds.pop(tier, None)
            if build is None:
                return
            build.aborted = True
            built, build.built = build.built, None
        if built is not None:
            threading.Thread(target=self._engine.tiers.discard, args=built,
                             name=f"kvtier-discard-{tier}", daemon=True).start()

    def close(self) -> None:
        for tier in list(self.states()):
            self.abort(tier)

    def _build(self, tier: str, config: Config, build: _Build, commit: bool) -> None:
        try:
            built = self._engine.tiers.build(tier, config)
        except Exception as exc:  # reported to the caller; the rank goes on without it
            with self._lock:
                build.state, build.error = "failed", _reason(exc)
            logger.warning("kvtier: attaching tier %s failed: %s", tier, build.error)
            return
        if built[0].stats().get("down"):  # built, but nothing answers there
            self._engine.tiers.discard(*built)
            with self._lock:
                build.state = "failed"
                build.error = (f"tier {tier!r} is unreachable: its connect failed or timed "
                               f"out (see this server's log)")
            logger.warning("kvtier: attaching tier %s failed: %s", tier, build.error)
            return
        with self._lock:
            discard = build.aborted
            if not discard:
                build.state, build.built = "built", built
        if discard:
            self._engine.tiers.discard(*built)
        elif commit:
            try:
                self.commit(tier)
            except ValueError as exc:  # aborted or attached meanwhile
                logger.warning("kvtier: attaching tier %s: %s", tier, exc)


def _reason(exc: BaseException) -> str:
    """What went wrong, without text a third-party exception may have copied from a URL."""
    from kvtier.errors import KVTierError

    if isinstance(exc, (KVTierError, ValueError)):
        return str(exc)
    return type(exc).__name__
