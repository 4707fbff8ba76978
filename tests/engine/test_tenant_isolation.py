"""No tenant's traffic makes kvtier delete another tenant's chunks (issue 71, item 5), on the
paths that delete or unpin: shadow verification's purge (the widest, scope tail: a suspect
prefix leaves every tier) and session pins (a tenant's sessions push others' pins past the
cap). Tenants hold the same prompt under their own salts, so a key shared by mistake would
show as the other tenant's loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.connectors import SGLangMHAConnector
from kvtier.engine import CacheEngine

CHUNK, LAYERS = 16, 4
SLOTS = 256
TIER_CHUNKS = 64  # the CPU tier, in 4 KiB chunks (16 tokens x 2 heads x 8 x 4 B x 2 x 4 layers)
A, B = "tenant-a", "tenant-b"


class _Pool(SGLangMHAConnector):
    """An MHA pool whose buffers the test keeps (to change the KV under the engine)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.k, self.v = ([torch.randn(SLOTS, 2, 8, generator=gen) for _ in range(LAYERS)]
                          for _ in range(2))
        super().__init__(self.k, self.v)


def _engine(tmp_path: Path, pool: _Pool, **values: object) -> CacheEngine:
    cfg = Config(**{"chunk_size": CHUNK, "max_local_cpu_size": TIER_CHUNKS * 4096 / 1e9,
                    "save_tails": False, "local_disk": str(tmp_path / "disk"),
                    "max_local_disk_size": 0.05, **values})  # type: ignore[arg-type]
    return CacheEngine(cfg, model_name="m", layout=pool.layout, connector=pool)


def _tokens(seed: int, chunks: int = 4) -> torch.Tensor:
    return torch.randint(0, 30_000, (chunks * CHUNK,),
                         generator=torch.Generator().manual_seed(seed))


def test_a_tenants_verification_purge_leaves_anothers_same_prompt(tmp_path: Path) -> None:
    """A's request finds its loaded prefix suspect (its fresh last chunk differs from every
    tier's record, and the CPU tier that supplied the prefix holds one that differs): A's
    chunks leave every tier. B's records of the same tokens are untouched in every tier."""
    pool = _Pool()
    tokens, slots = _tokens(3), torch.arange(4 * CHUNK)
    with _engine(tmp_path, pool) as eng:
        for salt in (A, B):
            assert eng.store(tokens, slots, salt=salt) == 4 * CHUNK
        assert eng.flush(30)
        for layer in range(2, LAYERS):  # A's last chunk computed by a changed model
            pool.v[layer][slots[3 * CHUNK:]] *= 1.05
        result = eng.verify(tokens, slots, start=3 * CHUNK, loaded=True, salt=A)
        assert result.purged > 0 and result.stored == 0
        assert eng.flush(30)
        assert eng.lookup(tokens, salt=A) == 0
        assert eng.lookup(tokens, hot_only=True, salt=B) == 4 * CHUNK
        disk = eng._storage.lower_tiers[0]
        assert disk.batch_contains(eng.key_chain(tokens, B)) == 4
        assert disk.batch_contains(eng.key_chain(tokens, A)) == 0


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_tenants_sessions_and_traffic_leave_anothers_prompt(tmp_path: Path,
                                                              fraction: float) -> None:
    """B pins its prompt in a session; A opens sessions until the pin cap drops B's pins
    (the cap is the tier's, oldest session first), then stores 3x the tier. B's prompt stays
    whole in the CPU tier under the share; without one A's traffic takes it."""
    pool = _Pool()
    slots = torch.arange(4 * CHUNK)
    quiet = _tokens(1)
    with _engine(tmp_path, pool, tenant_max_fraction=fraction,
                 local_disk=None, max_local_disk_size=0.0) as eng:
        assert eng.store(quiet, slots, salt=B, session_id="b-session") == 4 * CHUNK
        for i in range(TIER_CHUNKS // 4):  # A's sessions, each pinning a 4-chunk prompt
            assert eng.store(_tokens(100 + i), slots, salt=A, session_id=f"a-{i}") == 4 * CHUNK
        stats = eng.stats()
        assert stats["session_unpins_cap"] > 0  # B's pins went for A's: the cap is shared
        for i in range(3 * TIER_CHUNKS // 4):  # then 3x the tier, no session
            eng.store(_tokens(1000 + i), slots, salt=A)
        held = eng.lookup(quiet, hot_only=True, salt=B)
        assert held == (4 * CHUNK if fraction < 1 else 0)


def test_blended_segments_stay_within_their_tenant(tmp_path: Path) -> None:
    """A segment (a document blended at any position) stored by A is not found by B; A's
    segment verification, finding A's records differ from a fresh computation, removes them
    from every tier, and B's records of the same document stay in every tier."""
    from kvtier.blend.segments import find_segments
    from kvtier.engine.segments import SegmentStore
    from kvtier.keys import KeyBuilder
    from kvtier.memory import KVLayout
    from kvtier.storage import StorageManager

    layout = KVLayout.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cfg = Config(chunk_size=CHUNK, max_local_cpu_size=0.016, save_tails=True,
                 local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05)
    storage = StorageManager(cfg, layout)
    keys = KeyBuilder(model="m", fingerprint=layout.fingerprint(CHUNK), chunk_size=CHUNK,
                      tails=True, page_size=4)
    store = SegmentStore(storage, keys, layout)
    try:
        tokens = [*range(100, 148), 0, 7]  # a 48-token document (3 chunks), a separator
        seg = find_segments(tokens, [0])[0]
        kv = torch.randn(layout.shape(48), generator=torch.Generator().manual_seed(0))
        assert store.save(store.chain(tokens, seg, A), kv) == 48
        assert store.lookup(store.chain(tokens, seg, B)) == 0  # not B's to find
        assert store.save(store.chain(tokens, seg, B), kv) == 48
        assert storage.flush(30)
        verdicts = store.verify(store.chain(tokens, seg, A), kv * 1.05)  # A's differ
        assert verdicts and not any(v.matched for v in verdicts)
        assert storage.flush(30)
        assert store.lookup(store.chain(tokens, seg, A)) == 0
        chain_b = store.chain(tokens, seg, B)
        assert store.lookup(chain_b, hot_only=True) == 48
        assert storage.lower_tiers[0].batch_contains(list(chain_b)) == 3
    finally:
        storage.close()


def test_a_tenants_probe_reads_make_room_from_its_own_chunks(tmp_path: Path) -> None:
    """A tier's estimate probe reads a request's chunks into the arena (`probe_reads`); with
    the CPU tier full, that room is made by eviction, which takes the chunks of the tenant over
    its share: tenant A's probes cost A, never B's prompt."""
    import threading

    from kvtier.storage.prefetch.planner import probe_reads

    pool = _Pool()
    slots = torch.arange(4 * CHUNK)
    quiet = _tokens(1)
    noisy = [_tokens(100 + i) for i in range(3 * TIER_CHUNKS // 4)]
    with _engine(tmp_path, pool) as eng:
        assert eng.store(quiet, slots, salt=B) == 4 * CHUNK
        for tokens in noisy:  # 3x the CPU tier, each written down
            assert eng.store(tokens, slots, salt=A) == 4 * CHUNK
            assert eng.flush(30)
        disk = eng._storage.lower_tiers[0]
        before = eng.stats()["cpu.evictions"]
        for tokens in noisy[:8]:  # chunks the CPU tier no longer holds, read from disk
            probe_reads(disk, list(eng.key_chain(tokens, A)))
            for thread in threading.enumerate():
                if thread.name == "kvtier-probe-disk":
                    thread.join(30)
        assert eng.stats()["cpu.evictions"] > before  # the reads took room
        assert eng.lookup(quiet, hot_only=True, salt=B) == 4 * CHUNK
