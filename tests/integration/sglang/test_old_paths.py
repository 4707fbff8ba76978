"""The module paths users and installed entry points name from before the sub-packages (issue
73) still import the same objects: the SGLang plugin entry point and HiCache's module_path."""

from __future__ import annotations

import importlib

import pytest


def test_the_plugin_entry_point_of_an_earlier_install_still_registers() -> None:
    old = importlib.import_module("kvtier.integration.sglang.plugin")
    new = importlib.import_module("kvtier.integration.sglang.launch.plugin")
    assert old.register is new.register and old.BACKEND_NAME == new.BACKEND_NAME


def test_hicache_module_path_of_an_earlier_config_names_the_same_class() -> None:
    pytest.importorskip("sglang")
    old = importlib.import_module("kvtier.integration.sglang.hicache_storage")
    new = importlib.import_module("kvtier.integration.sglang.hicache.storage")
    assert old.KVTierHiCacheStorage is new.KVTierHiCacheStorage
