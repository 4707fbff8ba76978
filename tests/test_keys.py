from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvtier.keys import KeyBuilder, encode_tokens


def _builder(**kw: object) -> KeyBuilder:
    args: dict = {"model": "m", "fingerprint": "fp", "chunk_size": 16}
    args.update(kw)
    return KeyBuilder(**args)


def test_chained_digest_matches_the_spec() -> None:
    tokens = list(range(40))
    keys = _builder(salt="tenant", save_unfull_chunk=True).keys(tokens)
    h = hashlib.sha256(b"kvtier/v2" + b"tenant").digest()
    for key, (a, b) in zip(keys, [(0, 16), (16, 32), (32, 40)]):
        h = hashlib.sha256(h + np.arange(a, b, dtype="<u4").tobytes()).digest()
        assert key.key == f"kvtier/v2/default/m/fp/0of1/{h.hex()}"
        assert (key.start, key.end) == (a, b)
    assert keys[0].prev is None and keys[2].prev == keys[1].key


def test_list_tensor_and_array_agree() -> None:
    tokens = [5, 1, 2**31 + 7, 0] * 10
    kb = _builder()
    assert kb.keys(tokens) == kb.keys(torch.tensor(tokens)) == kb.keys(np.array(tokens))
    small = [t % 50_000 for t in tokens]
    assert kb.keys(torch.tensor(small, dtype=torch.int32)) == kb.keys(small)


def test_partial_chunk_only_when_configured() -> None:
    tokens = list(range(40))
    assert [k.end for k in _builder().keys(tokens)] == [16, 32]
    full = _builder(save_unfull_chunk=True).keys(tokens)
    assert [k.end for k in full] == [16, 32, 40]
    # A partial chunk never shares a key with a full chunk over the same start.
    longer = _builder(save_unfull_chunk=True).keys(list(range(48)))
    assert full[2].key != longer[2].key


def test_namespace_changes_every_key() -> None:
    tokens = list(range(32))
    base = _builder().keys(tokens)
    for other in (_builder(model="m2"), _builder(fingerprint="fp2"), _builder(salt="s"),
                  _builder(rank=1, world_size=2)):
        assert {k.key for k in other.keys(tokens)}.isdisjoint({k.key for k in base})


def test_prefix_sharing() -> None:
    kb = _builder()
    a = kb.keys(list(range(64)))
    b = kb.keys(list(range(32)) + [9] * 32)
    assert a[:2] == b[:2] and a[2].key != b[2].key


@pytest.mark.parametrize("bad", [[[1, 2]], [1.5, 2.0], [-1, 3], [2**32], "abc",
                                 torch.zeros(2, 2, dtype=torch.long), torch.zeros(3)])
def test_bad_tokens_raise_value_error_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match="token_ids"):
        _builder().keys(bad)  # type: ignore[arg-type]


def test_empty_input_has_no_keys() -> None:
    assert _builder().keys([]) == []
    assert bytes(encode_tokens(torch.tensor([], dtype=torch.long))) == b""


def test_keys_identical_across_interpreters() -> None:
    code = ("from kvtier.keys import KeyBuilder; import torch;"
            "kb = KeyBuilder(model='m', fingerprint='fp', chunk_size=16, salt='s');"
            "print(','.join(k.key for k in kb.keys(torch.arange(100) * 7919 % 50000)))")
    outs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                   capture_output=True, text=True).stdout)
    assert outs[0] == outs[1] and outs[0].count("kvtier/v2") == 6


def test_key_strings_parse_and_map_to_redis_names_and_back() -> None:
    from kvtier.keys import KeySpace, key_of_redis_name, redis_names, stub_key

    kb = KeyBuilder(model="llama", fingerprint="fp1", chunk_size=16, rank=1, world_size=2)
    key = kb.keys(list(range(32)))[1].key
    parsed = KeySpace.parse(key)
    assert parsed is not None
    space, digest = parsed
    assert space == KeySpace("llama", "fp1", "1of2") == kb.space and space.key(digest) == key
    assert key.endswith("/" + digest) and len(digest) == 64
    names = redis_names(key, 3)
    assert names[0].endswith("{" + digest + "}") and names[2] == names[0] + "#2"
    assert {key_of_redis_name(name) for name in names} == {key}
    assert KeySpace.parse("not/a/kvtier/key") is None
    assert KeySpace.parse("kvtier/v2/a/b/c/d") is None
    assert stub_key(key).key == key and stub_key(key).num_tokens == 0


def test_model_names_map_to_one_key_component_reversibly() -> None:
    from kvtier.keys import KeySpace, model_component, model_name_of

    names = ["org/model", "org--model", "a b", "a_b", "meta-llama/Llama-3-8B", "x#y", "{tag}",
             "m@v2", "100%"]
    components = [model_component(n, "0123abcd") for n in names]
    assert len(set(components)) == len(names)  # no two names share keys
    for name, comp in zip(names, components):
        assert "/" not in comp and "{" not in comp and "#" not in comp and " " not in comp
        assert model_name_of(comp) == name
        space = KeySpace(comp, "fp", "0of1", "tenant-a")
        parsed = KeySpace.parse(space.key("ab" * 32))
        assert parsed is not None and parsed[0] == space
    with pytest.raises(ValueError, match="empty"):
        model_component("")


def test_namespace_and_fingerprint_separate_keys() -> None:
    tokens = list(range(32))
    base = _builder().keys(tokens)
    other_ns = KeyBuilder(model="m", fingerprint="fp", chunk_size=16, namespace="t2").keys(tokens)
    other_fp = KeyBuilder(model="m@ffff", fingerprint="fp", chunk_size=16).keys(tokens)
    assert not {k.key for k in base} & {k.key for k in other_ns}
    assert not {k.key for k in base} & {k.key for k in other_fp}
    with pytest.raises(ValueError, match="namespace"):
        KeyBuilder(model="m", fingerprint="fp", chunk_size=16, namespace="a/b")


def test_hicache_page_keys_are_salted_per_tenant() -> None:
    from kvtier.keys import KeySpace

    space = KeySpace("m@hicache-flat", "fp")
    plain = space.opaque_keys(["aa" * 32, "bb" * 32], 16)
    salted = space.opaque_keys(["aa" * 32, "bb" * 32], 16, salt="tenant")
    other = space.opaque_keys(["aa" * 32, "bb" * 32], 16, salt="other")
    assert len({k.key for k in plain + salted + other}) == 6
    assert salted[1].prev == salted[0].key


def test_a_request_salt_gives_its_own_keys() -> None:
    tokens = list(range(48))
    kb = _builder()
    plain, a, a_again, b = (kb.keys(tokens), kb.keys(tokens, "a"), kb.keys(tokens, "a"),
                            kb.keys(tokens, "b"))
    assert a == a_again
    assert len({k.key for k in plain + a + b}) == 3 * len(plain)
    assert [k.tokens for k in a] == [k.tokens for k in plain]  # same tokens, other chain


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_kernels_token_bytes_match_the_numpy_path(dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.kernels import ops

    assert ops.prepare() != "torch"  # the compiled helper, then the fallback without it
    top = 2**32 - 1 if dtype == torch.int64 else 2**31 - 1
    tokens = torch.tensor([0, 1, 255, 256, 65_536, 2**24 + 3, top], dtype=dtype)
    fast = bytes(encode_tokens(tokens))
    assert fast == np.array(tokens.tolist(), dtype="<u4").tobytes()
    bad = torch.tensor([3, -7, 2**32], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 2\*\*32\), got range "
                                         r"\[-7, 4294967296\]"):
        encode_tokens(bad)
    monkeypatch.setattr(ops, "token_bytes", lambda t: None)
    assert bytes(encode_tokens(tokens)) == fast
    with pytest.raises(ValueError, match=r"got range \[-7, 4294967296\]"):
        encode_tokens(bad)


def test_tensors_the_kernel_helper_does_not_take_go_the_numpy_way() -> None:
    from kvtier.kernels import ops

    ops.prepare()
    assert ops.token_bytes(torch.arange(4, dtype=torch.int16)) is None
    assert ops.token_bytes(torch.arange(4).reshape(2, 2)) is None
    assert bytes(encode_tokens(torch.arange(4, dtype=torch.int16))) == \
        np.arange(4, dtype="<u4").tobytes()
    strided = torch.arange(8)[::2]  # the helper takes it (it makes it contiguous)
    assert bytes(encode_tokens(strided)) == np.arange(0, 8, 2, dtype="<u4").tobytes()


def test_only_a_prompts_first_chunk_starts_a_prefix() -> None:
    """`starts_prefix` tells a prompt's first chunk (or a tail with nothing before it) from a
    blending segment's, another salt's and a later chunk (tier events announce only the
    first kind: kvtier/integration/sglang/rank/tier_events.py)."""
    builder = KeyBuilder(model="m", fingerprint="f", chunk_size=16, page_size=4, tails=True)
    tokens = list(range(40))
    for salt in ("", "tenant"):
        chain = builder.chain(tokens, salt)
        assert builder.starts_prefix(chain[0]) and not builder.starts_prefix(chain[1])
        assert builder.starts_prefix(builder.chain(tokens[:8], salt).tails(0)[0])
        assert not builder.starts_prefix(builder.chain(tokens, salt, segment=True)[0])
    other = builder.chain(tokens, "another")[0]
    assert not builder.starts_prefix(other._replace(salt=""))
