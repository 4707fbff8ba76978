"""LMCache's blending keys, loaded as kvtier keys: lists from YAML or the environment, each bad
value named."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return path


def test_blend_keys_load_lists_and_name_the_bad_key(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "enable_blending: true\nblend_recompute_ratios: [0.3, "
                             "0.1]\nblend_check_layers: [1, 4]\nblend_min_tokens: 64\n"), env={})
    assert cfg.blend.enabled and cfg.blend.ratios == (0.3, 0.1)
    assert cfg.blend.check_layers == (1, 4) and cfg.blend.min_tokens == 64
    assert cfg.blend.max_prefill_ratio == 1.0  # the default: a blend must not lose
    assert load_config(_write(tmp_path, "blend_max_prefill_ratio: 0.5\n"),
                       env={}).blend.max_prefill_ratio == 0.5
    assert cfg.blend.in_forward  # the default: SGLang's forward recomputes past the check layers
    assert not load_config(_write(tmp_path, "blend_in_forward: false\n"),
                           env={}).blend.in_forward
    assert load_config(_write(tmp_path, "blend_recompute_ratios: 0.2\n"), env={}).blend.ratios \
        == (0.2,)  # one value is a list of one
    env = {"LMCACHE_BLEND_CHECK_LAYERS": "[2]", "LMCACHE_BLEND_RECOMPUTE_RATIOS": "[0.5]"}
    assert load_config(env=env).blend.check_layers == (2,)
    for text, key in (("blend_recompute_ratios: [0.1, 0.3]\nblend_check_layers: [1, 2]",
                       "blend_recompute_ratios"),
                      ("blend_recompute_ratios: [1.5]", "blend_recompute_ratios"),
                      ("blend_recompute_ratios: [x]", "blend_recompute_ratios"),
                      ("blend_check_layers: [2, 1]\nblend_recompute_ratios: [0.2, 0.1]",
                       "blend_check_layers"),
                      ("blend_check_layers: [1, 2]", "blend_check_layers"),
                      ("blend_check_layers: [true]", "blend_check_layers"),
                      ("blend_min_tokens: 0", "blend_min_tokens"),
                      ("blend_max_prefill_ratio: 0", "blend_max_prefill_ratio"),
                      ("blend_max_prefill_ratio: .inf", "blend_max_prefill_ratio"),
                      ("blend_in_forward: maybe", "blend_in_forward"),
                      ("enable_blending: true\nblend_special_str: ''", "blend_special_str")):
        with pytest.raises(ConfigError, match=f": {key}: "):
            load_config(_write(tmp_path, text + "\n"), env={})
