from __future__ import annotations

import pytest
import torch

from kvtier.blend.rope import RotaryTable


@pytest.mark.parametrize("neox", [True, False])
def test_rerotation_equals_rope_at_the_new_position(neox: bool) -> None:
    table = RotaryTable.from_theta(64, 10000.0, 8192, neox=neox)
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(300, 3, 64, generator=g)
    old = torch.arange(300)  # a segment computed at positions 0..299
    cached = table.apply(raw, old)
    for shift in (1, 17, 4000):
        moved = table.rerotate(cached, shift)
        fresh = table.apply(raw, old + shift)
        assert torch.allclose(moved, fresh, atol=1e-4, rtol=0), shift
        assert not torch.allclose(cached, fresh, atol=1e-2)  # the rotation did something


def test_rerotation_per_token_shift_and_unrotated_tail() -> None:
    table = RotaryTable.from_theta(32, 500000.0, 1024)  # head_dim 48: 16 dims not rotated
    raw = torch.randn(10, 2, 48)
    cached = table.apply(raw, torch.arange(10))
    shift = torch.arange(10) * 7
    moved = table.rerotate(cached, shift)
    assert torch.allclose(moved, table.apply(raw, torch.arange(10) + shift), atol=1e-5)
    assert torch.equal(moved[..., 32:], raw[..., 32:])


def test_table_from_sglang_cache_layout_matches_theta() -> None:
    plain = RotaryTable.from_theta(16, 10000.0, 64)
    cache = torch.cat([plain.cos, plain.sin], dim=-1)  # SGLang's cos_sin_cache
    other = RotaryTable.from_cos_sin_cache(cache)
    x = torch.randn(5, 1, 16)
    pos = torch.tensor([0, 3, 9, 40, 63])
    assert torch.equal(other.apply(x, pos), plain.apply(x, pos))


def test_check_accepts_linear_tables_and_refuses_the_rest() -> None:
    plain = RotaryTable.from_theta(64, 10000.0, 32768)
    plain.check()
    scaled = RotaryTable(plain.cos * 1.1, plain.sin * 1.1)  # YaRN's mscale
    with pytest.raises(ValueError, match="does not compose"):
        scaled.check()
    pos = torch.arange(32768, dtype=torch.float64)[:, None] ** 1.05
    bent = pos * 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    with pytest.raises(ValueError, match="does not compose"):
        RotaryTable(bent.cos().float(), bent.sin().float()).check()


def test_refusals_name_the_argument() -> None:
    table = RotaryTable.from_theta(8, 10000.0, 16)
    with pytest.raises(ValueError, match="positions must lie in"):
        table.apply(torch.zeros(1, 1, 8), torch.tensor([16]))
    with pytest.raises(ValueError, match="shift must be >= 0"):
        table.rerotate(torch.zeros(1, 1, 8), -1)
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryTable.from_theta(7, 10000.0, 16)
    with pytest.raises(ValueError, match="head_dim 4 < rotary_dim 8"):
        table.apply(torch.zeros(1, 1, 4), torch.tensor([0]))
