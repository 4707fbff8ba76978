"""kvtier.connectors.hugepages: the kernel is asked for huge pages under exactly the whole huge
pages of each tensor, contents never change, and a refusal is a value (checked in /proc)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvtier.config import load_config
from kvtier.connectors import hugepages
from kvtier.errors import ConfigError

MiB = 1 << 20


def huge_page() -> int:
    return hugepages._huge_page_size()


def huge_bytes_at(addr: int) -> int:
    """AnonHugePages of the mapping holding `addr`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= addr < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def interior(t: torch.Tensor) -> int:
    size = huge_page()
    ptr = t.untyped_storage().data_ptr()
    return max(0, (ptr + t.untyped_storage().nbytes()) // size * size - (-(-ptr // size) * size))


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="transparent huge pages are a Linux feature")


@linux_only
def test_a_pool_is_collapsed_onto_huge_pages_with_its_contents_unchanged() -> None:
    pool = torch.randn(6 * MiB // 4)  # 6 MiB: at least two whole huge pages inside
    before = pool.clone()
    result = hugepages.back([pool], collapse=True)
    assert result.advised == interior(pool) >= 2 * huge_page()
    assert torch.equal(pool, before)
    if result.error is None:
        assert result.collapsed == result.advised
        assert huge_bytes_at(pool.data_ptr() + result.advised // 2) >= result.collapsed
    else:  # the kernel refused (no THP, an old kernel): said, nothing collapsed
        assert result.error.startswith("MADV_") and result.collapsed == 0
        assert "small pages kept" in result.describe()


def test_small_and_repeated_tensors_ask_nothing_twice() -> None:
    big = torch.zeros(5 * MiB, dtype=torch.uint8)
    views = [big[:MiB], big[MiB:], big]  # one storage, three views
    off_cpu = torch.empty(4 * MiB, device="meta")
    result = hugepages.back([torch.zeros(100), torch.empty(0), off_cpu, *views])
    assert result.advised == interior(big)
    assert result.collapsed == 0


def test_huge_pages_is_a_yaml_boolean_key(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("huge_pages: false\n")
    assert load_config(path, env={}).huge_pages is False
    assert load_config(env={}).huge_pages is True
    path.write_text("huge_pages: 'no'\n")
    with pytest.raises(ConfigError, match="huge_pages"):
        load_config(path, env={})
