"""`Prefix`: a prompt's tokens named once, the handle `CacheEngine`'s calls take."""

from __future__ import annotations

from kvtier.keys import ChunkKey, KeyBuilder, KeyChain, TokenIds

__all__ = ["Prefix"]


class Prefix:
    """A token sequence, its salt, and the keys kvtier names it by, each hashed on first use
    and kept: the key chain (what `lookup`, `start_prefetch` and `retrieve` walk: its full
    chunks and the tails that may follow them) and the chunk keys (what `store` writes: its
    whole chunks, then its partial one per `save_unfull_chunk`/`save_tails`).

    Made by `CacheEngine.prefix(token_ids, salt)`; give it to `lookup`, `start_prefetch`,
    `retrieve`, `store` and `verify` in place of token ids, so a request asked about at every
    scheduler step and loaded at admission hashes its prompt once. The caller must not change
    `token_ids` while the handle is in use (it is not copied).
    """

    __slots__ = ("_builder", "_chain", "_keys", "salt", "token_ids")

    def __init__(self, token_ids: TokenIds, salt: str, builder: KeyBuilder, *,
                 chain: KeyChain | None = None):
        if not isinstance(salt, str):
            raise ValueError(f"salt must be a str, got {type(salt).__name__}")
        if chain is not None and chain.salt != salt:
            raise ValueError("chain: hashed under another salt than this prefix's")
        self.token_ids = token_ids
        self.salt = salt
        self._builder = builder
        self._chain = chain
        self._keys: list[ChunkKey] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"Prefix({len(self)} tokens{', salted' if self.salt else ''})"

    @property
    def chain(self) -> KeyChain:
        """The keys a load walks (hashed at the first call, then kept)."""
        if self._chain is None:
            self._chain = self._builder.chain(self.token_ids, self.salt)
        return self._chain

    @property
    def keys(self) -> list[ChunkKey]:
        """The keys a store writes (hashed at the first call, then kept)."""
        if self._keys is None:
            self._keys = self._builder.keys(self.token_ids, self.salt)
        return self._keys

    def named_by(self, builder: KeyBuilder) -> bool:
        """Whether this prefix's keys are `builder`'s (one engine's model, layout and rank)."""
        return self._builder is builder

    def covers(self, token_ids: TokenIds) -> bool:
        """Whether this prefix's chain names `token_ids`' loads too: the same sequence, or a
        prefix of it this chain's tails reach (tokens past a load's `limit` name nothing)."""
        if self._chain is None:
            return False
        n = len(token_ids)
        return self._chain.num_tokens >= n and (self._chain.has_tails
                                               or self._chain.num_tokens == n)

    def reuse(self, token_ids: TokenIds) -> Prefix:
        """A prefix of `token_ids` sharing this one's hashed chain (see `covers`)."""
        if token_ids is self.token_ids:
            return self
        return Prefix(token_ids, self.salt, self._builder, chain=self._chain)

    def cut(self, end: int) -> Prefix:
        """The first `end` tokens, named afresh (a store's ephemeral span cut off)."""
        return self if end >= len(self) else Prefix(self.token_ids[:end], self.salt,
                                                    self._builder)
