"""Behaviour every storage tier must share (run once per backend)."""

from __future__ import annotations

from kvtier.backends import BackendContext, StorageBackend
from kvtier.keys import ChunkKey
from kvtier.memory import lease
from tests.helpers import make_keys, make_obj, put_random, same_bytes


def _put(backend: StorageBackend, ctx: BackendContext, keys: list[ChunkKey],
         seed: int = 0) -> list:
    """Put fresh objects for `keys`; return copies of what was put."""
    return put_random(backend.batch_put, ctx.allocator, ctx.layout, keys, seed)


def test_round_trip_is_byte_exact(backend_ctx: tuple[StorageBackend, BackendContext]) -> None:
    backend, ctx = backend_ctx
    keys = make_keys(40)  # 16 + 16 + a partial chunk of 8
    expected = _put(backend, ctx, keys)
    assert backend.batch_contains(keys) == 3
    with lease(backend.batch_get(keys)) as got:
        assert len(got) == 3
        for obj, want, key in zip(got, expected, keys):
            assert obj.num_tokens == key.num_tokens
            assert same_bytes(obj.tensor, want)


def test_prefix_semantics_stop_at_first_miss(
    backend_ctx: tuple[StorageBackend, BackendContext],
) -> None:
    backend, ctx = backend_ctx
    keys = make_keys(64)
    _put(backend, ctx, [keys[0], keys[1], keys[3]])
    assert backend.batch_contains(keys) == 2
    with lease(backend.batch_get(keys)) as got:
        assert len(got) == 2
    assert backend.batch_contains(keys[2:]) == 0
    assert backend.batch_get(keys[2:]) == []
    assert backend.batch_contains(keys[3:]) == 1


def test_first_held_finds_the_first_alternative_held(
    backend_ctx: tuple[StorageBackend, BackendContext],
) -> None:
    """Alternatives (a prefix's candidate tails), not a prefix: misses before a hit are
    skipped, not a stop."""
    backend, ctx = backend_ctx
    keys = make_keys(64)
    _put(backend, ctx, [keys[1], keys[3]])
    assert backend.first_held(keys) == 1
    assert backend.first_held([keys[0], keys[2], keys[3]]) == 2
    assert backend.first_held([keys[0], keys[2]]) == -1
    assert backend.first_held(make_keys(64, seed=1)) == -1
    assert backend.first_held([]) == -1
    backend.close()
    assert backend.first_held(keys) == -1


def test_other_prompt_and_other_model_miss(
    backend_ctx: tuple[StorageBackend, BackendContext],
) -> None:
    backend, ctx = backend_ctx
    _put(backend, ctx, make_keys(32))
    assert backend.batch_contains(make_keys(32, seed=1)) == 0
    assert backend.batch_contains(make_keys(32, model="other-model")) == 0


def test_same_key_other_tokens_is_a_miss(
    backend_ctx: tuple[StorageBackend, BackendContext],
) -> None:
    backend, ctx = backend_ctx
    keys = make_keys(16)
    _put(backend, ctx, keys)
    forged = keys[0]._replace(tokens=bytes(len(keys[0].tokens)))
    assert backend.batch_get([forged]) == []


def test_remove(backend_ctx: tuple[StorageBackend, BackendContext]) -> None:
    backend, ctx = backend_ctx
    keys = make_keys(48)
    _put(backend, ctx, keys)
    assert backend.remove(keys[1:2]) == 1
    assert backend.remove(keys[1:2]) == 0
    assert backend.batch_contains(keys) == 1
    assert backend.batch_contains(keys[2:]) == 1


def test_overwrite_keeps_latest(backend_ctx: tuple[StorageBackend, BackendContext]) -> None:
    backend, ctx = backend_ctx
    keys = make_keys(16)
    _put(backend, ctx, keys, seed=1)
    expected = _put(backend, ctx, keys, seed=2)
    with lease(backend.batch_get(keys)) as got:
        assert same_bytes(got[0].tensor, expected[0])


def test_close_is_idempotent_and_then_misses(
    backend_ctx: tuple[StorageBackend, BackendContext],
) -> None:
    backend, ctx = backend_ctx
    keys = make_keys(32)
    _put(backend, ctx, keys)
    backend.close()
    backend.close()
    assert backend.batch_get(keys) == []
    obj = make_obj(ctx.allocator, ctx.layout, 16, 0)
    with lease([obj]):
        assert backend.batch_put(keys[:1], [obj]) == 0


def test_touch_changes_nothing_held(backend_ctx: tuple[StorageBackend, BackendContext]) -> None:
    # A use served by a faster tier: held keys stay held and byte-exact, keys not held are
    # ignored (nothing is created), and after close it is a no-op.
    backend, ctx = backend_ctx
    keys = make_keys(64)
    expected = _put(backend, ctx, keys[:2])
    backend.touch(keys)
    backend.touch([])
    backend.touch(keys[2:])
    assert backend.batch_contains(keys) == 2
    assert backend.batch_contains(keys[2:]) == 0
    with lease(backend.batch_get(keys)) as got:
        assert [same_bytes(o.tensor, w) for o, w in zip(got, expected)] == [True, True]
    backend.close()
    backend.touch(keys)
    assert backend.batch_contains(keys) == 0


def test_stats_count_hits(backend_ctx: tuple[StorageBackend, BackendContext]) -> None:
    backend, ctx = backend_ctx
    keys = make_keys(32)
    _put(backend, ctx, keys)
    with lease(backend.batch_get(keys)):
        pass
    stats = backend.stats()
    assert stats["hits"] >= 2


def test_iter_get_closed_early_releases_what_it_read_ahead(
    backend_ctx: tuple[StorageBackend, BackendContext],
) -> None:
    backend, ctx = backend_ctx
    keys = make_keys(64)
    expected = _put(backend, ctx, keys)
    held = ctx.allocator.used_bytes  # what the tier itself keeps (the CPU tier: everything)
    stream = backend.iter_get(keys)
    first = next(stream)
    assert same_bytes(first.tensor, expected[0])
    stream.close()
    first.release()
    assert ctx.allocator.used_bytes == held
