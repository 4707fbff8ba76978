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


def test_the_plugins_hooks_keep_their_names_there_after_the_split() -> None:
    """launch/plugin.py's hooks moved to flags.py and scheduler_hooks.py (issue 73); the names
    it had still import from it, as the same functions."""
    from kvtier.integration.sglang.launch import flags, plugin, scheduler_hooks

    assert plugin._check_launch is flags.check_launch
    assert (plugin._add_cli_args, plugin._from_cli_args) == (
        flags.around_add_cli_args, flags.around_from_cli_args)
    assert (plugin._enable_prefetch_hooks, plugin._run_batch, plugin._batch_result,
            plugin._on_idle) == (scheduler_hooks.after_scheduler_init,
                                 scheduler_hooks.before_run_batch,
                                 scheduler_hooks.before_batch_result, scheduler_hooks.before_idle)
    assert plugin.BACKEND_NAME == flags.BACKEND_NAME == "kvtier"
