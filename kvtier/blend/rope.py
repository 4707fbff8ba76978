"""Rotary position tables and the re-rotation of cached keys.

RoPE rotates each pair of a key's rotary dimensions by `position x frequency`. Rotations by
angles a and b compose to a rotation by a + b, so a key computed at position p is moved to
position p + d by rotating it once more, by the table's row for d: no un-rotation, no access to
the pre-rotation key. That holds exactly for tables whose angle is linear in the position
(plain RoPE, linear and Llama-3 scaling); a table that also scales magnitudes (YaRN's mscale) or
changes its frequencies with the sequence length does not compose, and `RotaryTable.check`
refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RotaryTable"]


@dataclass(frozen=True)
class RotaryTable:
    """cos and sin per position and rotary pair: `cos[p, i]`, `sin[p, i]`, `i < rotary_dim/2`.

    `neox`: pairs are (i, i + rotary_dim/2) (Llama, Qwen2: "rotate half"); otherwise the
    interleaved pairs (2i, 2i + 1) of GPT-J. Dimensions past `rotary_dim` are not rotated.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    neox: bool = True

    @classmethod
    def from_theta(cls, rotary_dim: int, theta: float, max_positions: int,
                   neox: bool = True) -> RotaryTable:
        """The plain RoPE table: frequency `theta ** (-2i / rotary_dim)`."""
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        if theta <= 0 or max_positions <= 0:
            raise ValueError(f"theta and max_positions must be positive, got {theta}, "
                             f"{max_positions}")
        inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq
        return cls(angles.cos().float(), angles.sin().float(), neox)

    @classmethod
    def from_cos_sin_cache(cls, cache: torch.Tensor, neox: bool = True) -> RotaryTable:
        """A table from SGLang's `rotary_emb.cos_sin_cache` ([positions, rotary_dim]: cos
        halves, then sin halves)."""
        if cache.dim() != 2 or cache.shape[1] % 2:
            raise ValueError(f"cos_sin_cache must be [positions, even rotary_dim], got "
                             f"{tuple(cache.shape)}")
        cos, sin = cache.float().chunk(2, dim=-1)
        return cls(cos.contiguous(), sin.contiguous(), neox)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.cos.shape[1]

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`x` ([tokens, heads, head_dim]) rotated by each token's row of the table; a new
        tensor in `x`'s dtype (computed in float32)."""
        if x.dim() != 3 or positions.shape != x.shape[:1]:
            raise ValueError(f"x must be [tokens, heads, head_dim] with one position per token,"
                             f" got x {tuple(x.shape)}, positions {tuple(positions.shape)}")
        if x.shape[-1] < self.rotary_dim:
            raise ValueError(f"head_dim {x.shape[-1]} < rotary_dim {self.rotary_dim}")
        if positions.numel() and (int(positions.min()) < 0
                                  or int(positions.max()) >= self.max_positions):
            raise ValueError(f"positions must lie in [0, {self.max_positions}), got "
                             f"[{int(positions.min())}, {int(positions.max())}]")
        pos = positions.to(self.cos.device, torch.long)
        cos = self.cos[pos][:, None, :].to(x.device)
        sin = self.sin[pos][:, None, :].to(x.device)
        rot = self.rotary_dim
        out = x.float().clone()
        if self.neox:
            a, b = x[..., : rot // 2].float(), x[..., rot // 2 : rot].float()
            out[..., : rot // 2] = a * cos - b * sin
            out[..., rot // 2 : rot] = b * cos + a * sin
        else:
            a, b = x[..., 0:rot:2].float(), x[..., 1:rot:2].float()
            out[..., 0:rot:2] = a * cos - b * sin
            out[..., 1:rot:2] = b * cos + a * sin
        return out.to(x.dtype)

    def rerotate(self, keys: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
        """Keys rotated at positions p moved to p + `shift` (an int, or one per token, each
        >= 0): the same as rotating the unrotated keys at p + shift, up to rounding."""
        if isinstance(shift, int):
            if shift < 0:
                raise ValueError(f"shift must be >= 0, got {shift}")
            shift = torch.full((keys.shape[0],), shift, dtype=torch.long)
        elif shift.numel() and int(shift.min()) < 0:
            raise ValueError(f"shift must be >= 0, got min {int(shift.min())}")
        return self.apply(keys, shift)

    def check(self, probes: int = 4) -> None:
        """`ValueError` unless rotating by row a then row b equals rotating by row a + b: the
        property re-rotation relies on. The bound (1e-2 relative) passes the rounding of a
        float32 table at 10^5 positions (~1e-3 rad) and fails YaRN's magnitude scaling (>= 7%)
        and any frequency that changes with the position."""
        n = self.max_positions
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, 1, self.rotary_dim, generator=gen)
        for a, b in [(1, 1), (3, n // 3), (n // 4, n // 2), (n // 2 - 1, n // 2)][:probes]:
            if a + b >= n:
                continue
            twice = self.apply(self.apply(x, torch.tensor([a])), torch.tensor([b]))
            once = self.apply(x, torch.tensor([a + b]))
            err = float((twice - once).norm() / once.norm())
            if err > 1e-2:
                raise ValueError(f"this rotary table does not compose (rows {a} + {b} differ "
                                 f"from row {a + b} by {err:.2e} relative): its angles are not "
                                 f"linear in the position (YaRN, dynamic NTK), so cached keys "
                                 f"cannot be moved to new positions")
