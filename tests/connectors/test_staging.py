"""The staged GPU path's planning on CPU: groups of chunks per staging buffer, the memcpy
runs over chunks adjacent in memory, and the `KVTIER_GPU_COPY` switch (tests/gpu/ runs the
pipeline itself)."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors import staging
from kvtier.errors import ConfigError


@pytest.mark.parametrize("sizes,target,want", [
    ([], 10, []),
    ([4, 4, 4], 10, [range(0, 2), range(2, 3)]),
    ([4, 6, 1], 10, [range(0, 2), range(2, 3)]),
    ([12, 3, 12], 10, [range(0, 1), range(1, 2), range(2, 3)]),  # a large chunk goes alone
    ([0, 0, 10, 0], 10, [range(0, 4)]),
])
def test_groups_hold_whole_chunks_within_the_target(sizes: list[int], target: int,
                                                    want: list[range]) -> None:
    got = staging.groups(sizes, target)
    assert got == want
    assert [i for part in got for i in part] == list(range(len(sizes)))


def test_contiguous_runs_follow_the_bytes() -> None:
    flat = torch.arange(40, dtype=torch.float32)
    a, b, c = flat[0:8].view(2, 4), flat[8:16].view(2, 4), flat[24:32].view(2, 4)
    other = torch.zeros(2, 4)
    assert staging.contiguous_runs([a, b, c, other]) == [range(0, 2), range(2, 3), range(3, 4)]
    assert staging.contiguous_runs([b, a]) == [range(0, 1), range(1, 2)]  # out of order
    assert staging.contiguous_runs([]) == []


def test_copy_moves_each_tensor_through_merged_runs() -> None:
    src = torch.arange(48, dtype=torch.int32)
    srcs = [src[0:8].view(2, 4), src[8:16].view(2, 4), src[32:48].view(2, 8)]
    dst = torch.zeros(32, dtype=torch.int32)
    dsts = [dst[0:8].view(2, 4), dst[8:16].view(2, 4), dst[16:32].view(2, 8)]
    staging._copy(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


@pytest.mark.parametrize("raw,want", [("", "staged"), ("staged", "staged"),
                                      ("mapped", "mapped")])
def test_copy_path_reads_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str,
                                         want: str) -> None:
    monkeypatch.setenv("KVTIER_GPU_COPY", raw)
    assert staging.copy_path() == want


def test_a_bad_copy_path_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_GPU_COPY", "uva")
    with pytest.raises(ConfigError, match="KVTIER_GPU_COPY.*'uva'"):
        staging.copy_path()
