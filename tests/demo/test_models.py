"""The demo's generated models: cached by spec, rebuilt when the spec changes, deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.demo.models import LlamaSpec, cached_llama
from kvtier.demo.workload import Conversation, TextPrompts, Workload


@pytest.mark.sglang  # writes the model with transformers, which `make sglang-env` installs
def test_cached_llama_builds_once_per_spec(tmp_path: Path) -> None:
    spec = LlamaSpec(hidden=64, layers=1)
    path, built = cached_llama(spec, tmp_path)
    assert built and (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    weights = (path / "model.safetensors").read_bytes()
    again, built_again = cached_llama(spec, tmp_path)
    assert (again, built_again) == (path, False)

    other, built_other = cached_llama(LlamaSpec(hidden=64, layers=2), tmp_path)
    assert built_other and other != path
    # Same spec, same bytes: a regenerated model serves KV stored from the old one.
    rebuilt, _ = cached_llama(spec, tmp_path / "elsewhere")
    assert (rebuilt / "model.safetensors").read_bytes() == weights
    assert not list((tmp_path / "models").glob(".*"))  # no half-built leftovers


@pytest.mark.parametrize("kwargs", [{"hidden": 0}, {"hidden": 96, "heads": 5},
                                    {"heads": 4, "kv_heads": 3}, {"dtype": "int8"}])
def test_bad_spec_names_the_field(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LlamaSpec(**kwargs)  # type: ignore[arg-type]


def test_turns_extend_the_conversation() -> None:
    wl = Workload(conversations=2, turns=3, system_prompt_tokens=40, user_tokens=5,
                  answer_tokens=2)
    a, b = Conversation(1), Conversation(2)
    first = a.next_prompt(wl, 1)
    assert first[:40] == b.next_prompt(wl, 1)[:40] == wl.system_prompt()
    assert first != b.next_prompt(wl, 1)
    a.answered(first, [7, 8])
    second = a.next_prompt(wl, 2)
    assert second[:len(first) + 2] == first + [7, 8] and len(second) == 40 + 2 * 5 + 2
    with pytest.raises(ValueError, match="system-prompt-tokens"):
        Workload(system_prompt_tokens=0)


def test_demo_rejects_bad_sizes_before_starting_anything(capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path) -> None:
    from kvtier.cli import main

    out = tmp_path / "out"
    assert main(["demo", "--turns", "0", "--out", str(out)]) == 2
    assert "turns must be >= 1" in capsys.readouterr().err
    assert main(["demo", "--system-prompt-tokens", "20000", "--out", str(out)]) == 2
    assert "--system-prompt-tokens" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.sglang  # the real model's tokenizer: transformers, and the converted model
def test_real_text_prompts_have_the_workloads_exact_sizes_and_ask_a_question() -> None:
    from transformers import AutoTokenizer

    from kvtier.demo.runner import model_shape
    from kvtier.demo.smollm2 import cached_smollm2

    model, _ = cached_smollm2()
    # 30 layers, 3 KV heads of 64, float32, K and V; an 8192-token context
    assert model_shape(model) == (8192, 2 * 30 * 3 * 64 * 4)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    wl = Workload(conversations=2, turns=2, system_prompt_tokens=300, user_tokens=40)
    prompts = TextPrompts(wl, tokenizer)
    system = prompts.system_prompt()
    assert len(system) == 300 and system == TextPrompts(wl, tokenizer).system_prompt()
    assert tokenizer.decode(system).startswith(TextPrompts.PREAMBLE + "Record 1: The depot in ")
    first, other = prompts.user_message(1, 1), prompts.user_message(2, 1)
    assert len(first) == len(other) == 40 and first != other
    assert tokenizer.decode(first).endswith(" hold?\nAnswer:")
    a = Conversation(1)
    assert a.next_prompt(prompts, 1) == system + first


@pytest.mark.parametrize("salt", ["123456789012", "0123", "deadbeef0001"])
def test_the_demo_config_keeps_any_salt_a_string(tmp_path: Path, salt: str) -> None:
    """The run's salt is 12 hex digits: all digits (about 1 run in 280) read as an int, and
    the servers refused the config (a fresh-clone CI run: 'hash_salt: must be a string')."""
    from kvtier.config import load_config
    from kvtier.demo.runner import demo_config

    path = tmp_path / "kvtier.yaml"
    path.write_text(demo_config(tmp_path / "disk", "redis://127.0.0.1:1", salt, 0.1))
    config = load_config(path, env={})
    assert config.hash_salt == salt and config.local_disk == str(tmp_path / "disk")
