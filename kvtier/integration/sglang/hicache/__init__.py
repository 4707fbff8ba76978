"""kvtier as an L3 for SGLang's hierarchical cache (HiCache): `storage.KVTierHiCacheStorage`."""
