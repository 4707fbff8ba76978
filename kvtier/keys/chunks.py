"""Chunking and chained chunk keys.

A chunk's digest is `h_i = SHA-256(h_{i-1} || tokens_i)` with tokens encoded as little-endian
uint32 and `h_{-1} = SHA-256(b"kvtier/v2" || salt)`. The digest of a chunk therefore names its
whole prefix, and is the same in every process and on every machine.

A tail is a partial chunk (fewer than `chunk_size` tokens, a whole number of pages) keyed the
same way after the digest of the full chunks before it: a longer prompt that runs through a
stored tail finds it by hashing each page-aligned length of its own next tokens (`KeyChain`).

The key strings these chunks are named by (`KeySpace`) are built from `kvtier.keys.names`'
components (version, model component, tenant tag).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvtier.config.names import NAMESPACE_PATTERN
from kvtier.kernels.tokens import encode_tokens
from kvtier.keys.names import KEY_VERSION, TAG_PREFIX, tenant_tag

__all__ = ["ChunkKey", "KeyBuilder", "KeyChain", "KeySpace", "stub_key", "TokenIds"]

TokenIds = torch.Tensor | Sequence[int] | np.ndarray  # a prompt's token ids, as callers hold them


class ChunkKey(NamedTuple):
    """One chunk of a token sequence and the key it is stored under."""

    key: str  # kvtier/v2/{namespace}/{model}/{fingerprint}/{rank}of{world}/{hex digest}
    start: int  # first token index of the chunk in the sequence
    end: int  # one past the last token index
    # The chunk's own token ids, little-endian uint32: bytes, or for a tail candidate a
    # read-only view of the one copy its position's candidates share (`KeyBuilder.tail_keys`).
    tokens: bytes | memoryview
    prev: str | None  # the previous chunk's key, None for the first chunk
    # The request's salt (SGLang's `cache_salt`, "" for none): the tenant whose record key
    # seals the chunk on disk and in Redis (kvtier.keys.tenant_keys).
    salt: str = ""

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class KeySpace(NamedTuple):
    """One namespace of chunk keys: `kvtier/v2/{namespace}/{model}/{layout}/{shard}/{digest}`.

    The one place key strings are built and parsed: `KeyBuilder` and the HiCache backend name
    chunks with it, `kvtier ls` reads namespace, model and layout back with `parse`.
    """

    model: str  # a `model_component`
    layout: str  # the layout fingerprint (`KVLayout.fingerprint`)
    shard: str = "0of1"  # "{rank}of{world}"; the HiCache backend adds "-pp{rank}of{size}"
    namespace: str = "default"

    @property
    def prefix(self) -> str:
        return f"{KEY_VERSION}/{self.namespace}/{self.model}/{self.layout}/{self.shard}/"

    def key(self, digest: str) -> str:
        return self.prefix + digest

    def opaque_keys(self, digests: Sequence[str], num_tokens: int,
                    prev: str | None = None, salt: str = "") -> list[ChunkKey]:
        """Keys of chunks named by digests computed elsewhere (SGLang HiCache's page hashes),
        chained after digest `prev`. With `salt` (`hash_salt`) a key holds SHA-256(salt,
        digest) instead of the digest: tenants with different salts never share a chunk. No
        token ids are known, so each key carries `num_tokens` x 4 bytes derived from its key
        string instead: records still verify that what they hold belongs to the key."""
        def salted(digest: str) -> str:
            if not salt:
                return digest
            return hashlib.sha256(f"{KEY_VERSION}\0{salt}\0{digest}".encode()).hexdigest()

        out = []
        prev_key = None if prev is None else self.key(salted(prev))
        for digest in digests:
            key = self.key(salted(digest))
            seed = hashlib.sha256(key.encode()).digest()
            tokens = (seed * (num_tokens * 4 // len(seed) + 1))[: num_tokens * 4]
            out.append(ChunkKey(key, 0, num_tokens, tokens, prev_key))
            prev_key = key
        return out

    @staticmethod
    def parse(key: str) -> tuple[KeySpace, str] | None:
        """The namespace and digest of a kvtier key string (a tenant's too: its tag, before
        the digest, is `tag_of_key`'s); None for anything else."""
        parts = key.split("/")
        tagged = len(parts) == 8 and parts[6].startswith(TAG_PREFIX)
        if len(parts) != 7 and not tagged or "/".join(parts[:2]) != KEY_VERSION:
            return None
        return KeySpace(parts[3], parts[4], parts[5], parts[2]), parts[-1]


def stub_key(key: str) -> ChunkKey:
    """A `ChunkKey` that carries only its key string: for tier calls that look at key strings
    alone (`batch_contains`, `remove`), when the tokens are not known."""
    return ChunkKey(key, 0, 0, b"", None)


class KeyChain(list[ChunkKey]):
    """The keys of one token sequence's full chunks (a list), and the tails that may hang after
    any of them: `tails(i)` names every page-aligned partial chunk that could follow the first
    `i` full chunks, longest first. Computed on first use per position, then kept, so a
    request asked about on every scheduler step hashes its candidates once.

    A chain is everything a load needs to name what it reads: it carries the request's `salt`
    (hashed into every key) and, once cut by `upto(limit)`, the last token a load may reach."""

    def __init__(self, keys: Sequence[ChunkKey], data: memoryview, root: bytes,
                 builder: KeyBuilder, *, salt: str = "", limit: int | None = None,
                 tails: dict[int, list[ChunkKey]] | None = None):
        super().__init__(keys)
        self._data = data
        self._root = root
        self._builder = builder
        self.salt = salt
        self.limit = len(data) // 4 if limit is None else limit
        self._tails: dict[int, list[ChunkKey]] = {} if tails is None else tails

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence (what a tail may reach to, before `limit`)."""
        return len(self._data) // 4

    @property
    def has_tails(self) -> bool:
        return self._builder.tails

    def upto(self, limit: int) -> KeyChain:
        """This chain for a load of the first `limit` tokens at most: the chunks that start
        before it, and tails that end at or before it (their hashes shared with this one)."""
        limit = min(limit, self.limit)
        return KeyChain([k for k in self if k.start < limit], self._data, self._root,
                        self._builder, salt=self.salt, limit=limit, tails=self._tails)

    def tails(self, i: int, limit: int | None = None) -> list[ChunkKey]:
        """The tails that could follow the first `i` full chunks, longest first, ending at or
        before token `limit` (default: the chain's own `limit`)."""
        b = self._builder
        if not b.tails or i > len(self):
            return []
        cands = self._tails.get(i)
        if cands is None:
            cands = self._tails[i] = b.tail_keys(self._data, i, self[i - 1] if i else None,
                                                 self._root, self.salt)
        limit = self.limit if limit is None else min(limit, self.limit)
        return [k for k in cands if k.end <= limit] if cands and cands[0].end > limit \
            else cands


class KeyBuilder:
    """Cuts token sequences into chunks and names them for one (model, layout, rank) namespace."""

    def __init__(
        self,
        *,
        model: str,
        fingerprint: str,
        chunk_size: int,
        rank: int = 0,
        world_size: int = 1,
        salt: str = "",
        save_unfull_chunk: bool = False,
        namespace: str = "default",
        tails: bool = False,
        page_size: int = 1,
    ):
        if not model or any(c in model for c in " \n\t/"):
            raise ValueError(f"model must be a key component (no whitespace or /), got "
                             f"{model!r}: see model_component")
        if not NAMESPACE_PATTERN.fullmatch(namespace):
            raise ValueError(f"namespace must match {NAMESPACE_PATTERN.pattern}, got "
                             f"{namespace!r}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if page_size < 1 or chunk_size % page_size:
            raise ValueError(f"page_size must divide chunk_size={chunk_size}, got {page_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self.tails = tails
        self.page_size = page_size
        self.space = KeySpace(model, fingerprint, f"{rank}of{world_size}", namespace)
        self.prefix = self.space.prefix
        self._root = hashlib.sha256(KEY_VERSION.encode() + salt.encode()).digest()
        self._names = salt  # keys the tenant tags

    def prefix_of(self, salt: str) -> str:
        """The prefix of tenant `salt`'s keys: with its tag when salted (`tenant_tag`)."""
        return f"{self.prefix}{TAG_PREFIX}{tenant_tag(self._names, salt)}/" if salt \
            else self.prefix

    def num_keyed_tokens(self, num_tokens: int) -> int:
        """How many leading tokens of a `num_tokens` sequence are stored under keys: whole
        chunks, then the partial one (`save_unfull_chunk`) or its whole pages (`tails`)."""
        if self.save_unfull_chunk:
            return num_tokens
        if self.tails:
            return num_tokens - num_tokens % self.page_size
        return num_tokens - num_tokens % self.chunk_size

    def root(self, salt: str = "", segment: bool = False) -> bytes:
        """The digest every chain starts from (`h_{-1}`), with a request's `salt` mixed in.
        `segment`: the root of position-independent segments (kvtier.blend), whose KV was
        computed as if the segment were a whole prompt: never the same as a prefix's."""
        if segment:
            return hashlib.sha256(self._root + b"\0segment\0" + salt.encode()).digest()
        if not salt:
            return self._root
        return hashlib.sha256(self._root + b"\0cache_salt\0" + salt.encode()).digest()

    def starts_prefix(self, key: ChunkKey) -> bool:
        """Whether `key` begins a prompt's chain under its salt (its first chunk, or a tail
        with nothing before it), and not a segment's (`root(segment=True)`) nor any other
        chain's: its digest is the hash of its tokens after the root."""
        if key.prev is not None:
            return False
        d = hashlib.sha256(self.root(key.salt))
        d.update(key.tokens)
        return key.key == self.prefix_of(key.salt) + d.hexdigest()

    def chain(self, token_ids: torch.Tensor | Sequence[int] | np.ndarray,
              salt: str = "", segment: bool = False) -> KeyChain:
        """The keys a lookup walks: `token_ids`' full chunks, with their tails (`tails` on).
        With tails off, the same keys as `keys` (the partial chunk too, per
        `save_unfull_chunk`), and no tails. `segment`: keys of a segment (see `root`)."""
        data = encode_tokens(token_ids)
        n = len(data) // 4
        full = n - n % self.chunk_size if self.tails else self.num_keyed_tokens(n)
        root = self.root(salt, segment)
        return KeyChain(self._chunk(data, full, root, salt), data, root, self, salt=salt)

    def tail_keys(self, data: memoryview, i: int, before: ChunkKey | None,
                  root: bytes, salt: str = "") -> list[ChunkKey]:
        """Every page-aligned partial chunk of `data` that could follow its first `i` full
        chunks (`before` the last of them, or None with the chain's `root`), longest first."""
        start = i * self.chunk_size
        avail = min(self.chunk_size - 1, len(data) // 4 - start)
        avail -= avail % self.page_size
        if avail <= 0:
            return []
        h = root if before is None else bytes.fromhex(before.key.rpartition("/")[2])
        # Linear in the candidates' tokens (issue 36, item 7): one running hash over the pages,
        # snapshotted (copy) at each page boundary, and one copy of the tokens they span, which
        # every candidate views (a candidate's own copy cost 35 MB at chunk_size 4096, page 1).
        d = hashlib.sha256(h)
        page = self.page_size * 4
        span = memoryview(data[start * 4:(start + avail) * 4].tobytes())
        out: list[ChunkKey] = []
        make = tuple.__new__
        prefix = self.prefix_of(salt)
        prev = None if before is None else before.key
        for stop in range(page, avail * 4 + 1, page):
            d.update(span[stop - page:stop])
            key = prefix + d.copy().hexdigest()
            out.append(make(ChunkKey, (key, start, start + (stop >> 2), span[:stop], prev,
                                       salt)))
        out.reverse()
        return out

    def keys(self, token_ids: torch.Tensor | Sequence[int] | np.ndarray,
             salt: str = "") -> list[ChunkKey]:
        """The chunk keys of `token_ids` in order (a trailing partial chunk per config).
        `salt`: a per-request salt (SGLang's `cache_salt`) mixed into the root digest, so
        only requests with the same salt share chunks."""
        data = encode_tokens(token_ids)
        return self.keys_from_bytes(data, salt)

    def inner_tail(self, token_ids: torch.Tensor | Sequence[int] | np.ndarray,
                   keys: Sequence[ChunkKey], n: int | None, salt: str = "") -> ChunkKey | None:
        """The tail of the first `n` of `token_ids` (in whole pages) when they end inside one of
        `keys` (their keys, chained from `salt`), whole chunk or tail: that key also names
        tokens past `n`, so a lookup of the first `n` alone, which finds tails by exact
        length, cannot name it. None without tails, or where `n` ends a chunk or is past
        `keys`. Hashes only the tail's tokens, after the digest of the chunk before it."""
        if n is None or not self.tails or not keys:
            return None
        n -= n % self.page_size
        i = n // self.chunk_size
        start = i * self.chunk_size
        if n == start or i >= len(keys) or keys[i].end <= n:
            return None
        before = keys[i - 1] if i else None
        h = self.root(salt) if before is None else \
            bytes.fromhex(before.key.rpartition("/")[2])
        tokens = encode_tokens(token_ids[start:n]).tobytes()
        d = hashlib.sha256(h)
        d.update(tokens)
        return ChunkKey(self.prefix_of(salt) + d.hexdigest(), start, n, tokens,
                        None if before is None else before.key, salt)

    def keys_from_bytes(self, data: bytes | memoryview, salt: str = "") -> list[ChunkKey]:
        """Keys of a sequence given as little-endian uint32 bytes (see `encode_tokens`)."""
        data = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
        return self._chunk(data, self.num_keyed_tokens(len(data) // 4), self.root(salt), salt)

    def _chunk(self, data: memoryview, end_all: int, h: bytes, salt: str) -> list[ChunkKey]:
        """Keys of `data`'s first `end_all` tokens, cut every `chunk_size`, chained from `h`."""
        step = self.chunk_size * 4
        sha256 = hashlib.sha256
        make = tuple.__new__  # ChunkKey(...) goes through a Python-level __new__: ~10% slower
        prefix = self.prefix_of(salt)
        prev: str | None = None
        out: list[ChunkKey] = []
        append = out.append
        for start in range(0, end_all * 4, step):
            stop = min(start + step, end_all * 4)
            tokens = data[start:stop]
            d = sha256(h)  # update() instead of `h + tokens`: no 1 KiB concatenation per chunk
            d.update(tokens)
            h = d.digest()
            key = prefix + h.hex()
            append(make(ChunkKey, (key, start >> 2, stop >> 2, tokens.tobytes(), prev, salt)))
            prev = key
        return out
