"""Record keys per tenant: each salt's records are sealed under a key of their own.

A tenant is a request's salt (SGLang's `cache_salt`, carried by every `ChunkKey` of its
chain). With a record key, a salted chunk's record is encrypted under the tenant's master key:
HKDF-Expand of the record key's master key with a fixed info string of its own and SHA-256 of
the salt (fixed length, whatever the salt). The per-record key is then derived from the
tenant's master key exactly as from the master key itself (HKDF-Expand with the record's nonce
and header), so the record format, the key id in the header and key rotation are unchanged: the
key id names the record key (the same for every tenant, so a reader without the key cannot tell
tenants apart by it), and the salt the reader asks under picks the tenant's key.

A record read under another salt than it was written with fails GCM's tag: a `ForgedEntry`, a
counted miss, never deleted. Unsalted chunks keep the master key itself, so records written
before per-tenant keys stay readable; a salted record written before them is read under its
tenant's key now, fails its tag, and is a miss (recomputed, then rewritten) until evicted.
"""

from __future__ import annotations

import functools
import hashlib

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

__all__ = ["TENANT_INFO", "tenant_master"]

# Fixed HKDF info string (sealing.py's convention: a new derivation gets a new string).
TENANT_INFO = b"kvtier record encryption v1: tenant master key\0"
# Derived keys kept per process: a serving instance sees far fewer tenants at a time, and one
# not kept costs a derivation (microseconds) per record.
_KEPT = 4096


def tenant_master(master: bytes, salt: str) -> bytes:
    """The master key of tenant `salt` under record key `master`: `master` itself for ""
    (records without a salt keep today's key), else derived (and kept, `_KEPT` at most)."""
    return _derive(master, salt) if salt else master


@functools.lru_cache(maxsize=_KEPT)
def _derive(master: bytes, salt: str) -> bytes:
    info = TENANT_INFO + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest()
    return HKDFExpand(hashes.SHA256(), 32, info=info).derive(master)
