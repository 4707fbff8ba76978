"""Redis URLs as kvtier shows them: no piece of a password in a message, a log or a repr."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError


def test_a_password_with_an_unescaped_ampersand_is_hidden_whole() -> None:
    """Issue 51, item 8: `sentinel_password=ab&cd` showed `cd` as a parameter name, in
    `redact_url` and in the parse error."""
    from kvtier.backends.redis.url import parse_remote_url
    from kvtier.config.urls import redact_url

    url = "redis-sentinel://h1:26379,h2:26379/svc?sentinel_password=s3cr&et9&ssl=true"
    shown = redact_url(url)
    assert "et9" not in shown and "s3cr" not in shown and shown.endswith("&***&ssl=true")
    with pytest.raises(ConfigError) as info:
        parse_remote_url(url)
    assert "et9" not in str(info.value) and "s3cr" not in str(info.value)
    assert "percent-encode '&'" in str(info.value)
