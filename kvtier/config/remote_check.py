"""The check of `remote_url` at config time: its scheme first (no imports), then the full parse
by the parser its tier registers in the tier table (`kvtier.config.tiers`), so a URL kvtier
cannot serve fails at `check-config` time, not when the tier is built. Messages name the key
and show the URL redacted (`redact_url`): "config: remote_url: problem"."""

from __future__ import annotations

from kvtier.config import tiers as tier_table
from kvtier.config.lmcache import compat
from kvtier.config.urls import redact_url
from kvtier.errors import ConfigError

__all__ = ["check_remote_url"]


def _fail(source: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {msg}")


def check_remote_url(url: str) -> None:
    """Scheme first (no imports), then the full parse of the tier serving it (its row's
    `url_parser`), at config time."""
    scheme, sep, _ = url.partition("://")
    shown = redact_url(url)
    supported = ", ".join(s + "://" for s in tier_table.remote_schemes())
    if scheme in compat.UNSUPPORTED_SCHEMES:
        raise _fail("config", "remote_url",
                    f"{shown!r}: kvtier cannot serve {scheme}:// "
                    f"({compat.UNSUPPORTED_SCHEMES[scheme]}); supported schemes: {supported}")
    spec = tier_table.url_tier(url) if sep else None
    if spec is None:
        raise _fail("config", "remote_url", f"{shown!r}: scheme must be one of {supported}")
    if not spec.url_parser:
        return
    try:
        parser = tier_table.load_attr(spec.url_parser)
    except ImportError as exc:
        raise _fail("config", "remote_url", f"the {spec.name} tier needs the "
                    f"{', '.join(map(repr, spec.packages))} package, which cannot be imported "
                    f"({exc}): pip install 'kvtier[{spec.extra}]'") from None
    try:
        parser(url)
    except ConfigError as exc:
        raise ConfigError(f"config: {exc}") from None
