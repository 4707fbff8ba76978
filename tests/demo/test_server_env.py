"""The demo and benchmark servers' environment: every arm allocates alike."""

from __future__ import annotations

import pytest

from kvtier.demo.server import server_env


def test_every_arm_gets_huge_page_allocations_unless_the_caller_chose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert server_env()["THP_MEM_ALLOC_ENABLE"] == "1"  # baselines as kvtier's own servers
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert server_env()["THP_MEM_ALLOC_ENABLE"] == "0"
