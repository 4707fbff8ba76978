"""Every launch check at once: the launcher and `kvtier check-config` report the same list of
problems for one config and one set of launch flags, all of them in one run, no traceback."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from kvtier.cli import main
from kvtier.config import Config, load_config
from kvtier.errors import ConfigError
from kvtier.integration.sglang.launch.flags import check_launch
from kvtier.integration.sglang.launch.preflight import engine_host_bytes, preflight

README = Path(__file__).resolve().parents[4] / "README.md"


def _model(tmp_path: Path, weights_bytes: int = 3000, **config: object) -> Path:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    shape = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "torch_dtype": "bfloat16", **config}
    (model / "config.json").write_text(json.dumps(shape))
    (model / "model.safetensors").write_bytes(b"\0" * weights_bytes)
    (model / "tokenizer.json").write_bytes(b"{}" * 100)  # not weights: not counted
    return model


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"page_size": 1, "tp_size": 1, "dp_size": 1,
                                 "load_format": "auto", "device": "cuda", **kw})


def test_the_engine_s_host_memory_is_its_pool_and_weights(tmp_path: Path) -> None:
    model = _model(tmp_path)
    # 2 (K, V) x 4 layers x 2 KV heads x 16 dims x 2 bytes = 512 bytes a token
    assert engine_host_bytes(_args(model_path=str(model), max_total_tokens=1000)) == \
        1000 * 512 + 3000
    assert engine_host_bytes(_args(model_path=str(model), max_total_tokens=1000,
                                   dtype="float32", dp_size=2)) == 2 * (1000 * 1024 + 3000)
    mla = _model(tmp_path / "mla", kv_lora_rank=32, qk_rope_head_dim=8)
    assert engine_host_bytes(_args(model_path=str(mla), max_total_tokens=10)) == \
        10 * 4 * 40 * 2 + 3000
    assert engine_host_bytes(_args(model_path=str(tmp_path), max_total_tokens=10)) is None


def test_every_problem_is_reported_at_once_by_the_launch_and_check_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model(tmp_path)
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({
        "chunk_size": 48, "max_local_cpu_size": 100000, "local_disk": str(tmp_path / "d"),
        "max_local_disk_size": 10**7, "metrics_port": 65535,
        "record_key_file": str(tmp_path / "missing.key")}))
    config = load_config(path, env={})
    flags = {"page_size": 32, "tp_size": 2, "load_format": "dummy", "device": "cpu",
             "model_path": str(model), "max_total_tokens": 4096}
    found = preflight(config, _args(**flags))
    keys = [p.split(":")[0] for p in found.problems]
    assert keys == ["chunk_size", "max_local_cpu_size", "max_local_disk_size",
                    "record_key_file", "--load-format dummy (random weights) with the disk tier",
                    "metrics_port", "max_local_cpu_size"], found.problems
    assert "for SGLang's CPU KV pool (--max-total-tokens 4096)" in found.problems[-1]

    with pytest.raises(ConfigError) as info:  # the launcher: one error, every problem listed
        check_launch(config, _args(**flags))
    assert "7 problems stop the launch" in str(info.value)
    for problem in found.problems:
        assert problem in str(info.value)

    argv = ["check-config", str(path)]
    for flag, value in flags.items():
        argv += [f"--{flag.replace('_', '-')}", str(value)]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    # the memory available moves between the two checks (13.73 GB, then 13.74, in a CI run)
    assert list(map(_steady, yaml.safe_load(out)["launch_problems"])) == \
        list(map(_steady, found.problems))
    assert err.count("kvtier: problem: on this host, ") == 7 and "Traceback" not in err
    nothing = tmp_path / "d"
    assert not nothing.exists()  # checked, never created


def test_a_cpu_launch_without_a_pool_size_is_a_note_not_a_refusal() -> None:
    found = preflight(Config(max_local_cpu_size=0.01), _args(device="cpu"))
    assert found.problems == [] and "--max-total-tokens" in found.notes[0]


def test_the_readme_example_config_loads_and_its_check_lists_problems_not_tracebacks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```yaml\n(# kvtier.yaml.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, "README must show one example kvtier.yaml"
    example = yaml.safe_load(blocks[0])
    example["local_disk"] = str(tmp_path / "cache")  # the README's path may not be writable
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump(example))
    loaded = load_config(path, env={})
    assert loaded.max_local_cpu_size <= 8, "the example must start on a small host"
    code = main(["check-config", str(path), "--device", "cpu", "--max-total-tokens", "65536"])
    out, err = capsys.readouterr()
    problems = yaml.safe_load(out).get("launch_problems", [])
    assert code == (1 if problems else 0) and "Traceback" not in err
    assert all(p.startswith("max_local_disk_size") for p in problems), problems


def test_parsing_launch_arguments_in_process_changes_nothing_about_exiting() -> None:
    """Only a launcher whose HTTP server starts takes over the stop (its exit skips the
    interpreter's finalization): a process that merely parses arguments, as these tests do,
    keeps its own exit status and environment."""
    import atexit

    from kvtier.integration.sglang.stop import shutdown

    before = atexit._ncallbacks()  # noqa: SLF001 - how many exit handlers are registered
    shutdown.prepare_launcher()
    assert shutdown.LAUNCHER_ENV not in os.environ and not shutdown.in_server()
    assert atexit._ncallbacks() == before  # noqa: SLF001


def test_a_shared_tier_needs_weights_it_can_digest_unless_the_config_allows(
        tmp_path: Path) -> None:
    disk = Config(local_disk=str(tmp_path / "kv"), max_local_disk_size=0.001)
    hub = _args(model_path="nobody/not-downloaded-model", revision=None)
    problems = preflight(disk, hub, available=1 << 40).problems
    assert len(problems) == 1 and problems[0].startswith("allow_unverified_weights: the disk "), \
        problems
    assert "'nobody/not-downloaded-model' is neither a local directory" in problems[0]
    empty = tmp_path / "config-only"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert "holds no weights file" in preflight(disk, _args(model_path=str(empty)),
                                                available=1 << 40).problems[0]
    # what passes: weights to digest, the key set, a CPU tier only, random weights, no model
    model = _model(tmp_path)
    allowed = Config(local_disk=str(tmp_path / "kv"), max_local_disk_size=0.001,
                     allow_unverified_weights=True)
    for config, args in ((disk, _args(model_path=str(model))), (allowed, hub),
                         (Config(), hub), (disk, _args(model_path=str(empty),
                                                       load_format="dummy")),
                         (disk, _args())):
        assert not [p for p in preflight(config, args, available=1 << 40).problems
                    if "allow_unverified_weights" in p], (config, args)


def test_blending_is_refused_at_launch_where_it_cannot_compute_exactly(tmp_path: Path) -> None:
    on = Config(max_local_cpu_size=0.01, enable_blending=True)
    llama = _model(tmp_path / "llama", architectures=["LlamaForCausalLM"])
    assert preflight(on, _args(model_path=str(llama))).problems == []
    assert preflight(Config(max_local_cpu_size=0.01), _args(model_path=str(llama),
                                                            tp_size=2)).problems == []
    # At --tp 2 the ranks blend in step on SGLang's CPU engine (blend_ranks.py), one check layer
    cpu_tp = _args(model_path=str(llama), tp_size=2, device="cpu")
    assert not [p for p in preflight(on, cpu_tp).problems if "blend" in p]
    [problem] = [p for p in preflight(Config(max_local_cpu_size=0.01, enable_blending=True,
                                             blend_check_layers=[1, 2],
                                             blend_recompute_ratios=[0.3, 0.1]),
                                      cpu_tp).problems if "blend" in p]
    assert problem.startswith("blend_check_layers: [1, 2]: at --tp 2 "), problem
    refused = {
        "--dp 1 only": _args(model_path=str(llama), dp_size=2),
        "must run in SGLang's forward": _args(model_path=str(llama), tp_size=2),
        "an MLA model": _args(model_path=str(_model(tmp_path / "mla", kv_lora_rank=32))),
        "not GPT2LMHeadModel": _args(model_path=str(_model(tmp_path / "gpt2",
                                                           architectures=["GPT2LMHeadModel"]))),
        "sliding window of 4096": _args(model_path=str(_model(
            tmp_path / "swa", architectures=["MistralForCausalLM"], sliding_window=4096))),
    }
    for reason, args in refused.items():
        [problem] = preflight(on, args).problems
        assert problem.startswith("enable_blending") and reason in problem, problem


def _steady(problem: str) -> str:
    """`problem` without the host's free memory, which changes from one moment to the next."""
    return re.sub(r"[\d.]+ GB (of memory available now|per rank)", r"N GB \1", problem)
