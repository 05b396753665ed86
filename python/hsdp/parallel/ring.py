"""Ring attention and USP (Ulysses x ring) for the NumPy reference model.

- :class:`Ring`: each rank of a ring group holds 1/ring of the sequence's q, k and v. The
  k/v block (one buffer holding both) passes around the ring by point-to-point
  ``sendrecv`` (never an all-gather): at each step the next block's transfer is started,
  this block's attention is computed while it moves (MPI: the backend's worker thread sends
  it, NumPy's matrix products release the GIL), then the transfer is waited. The partial
  results merge exactly through the softmax log-sum-exp, in float32 whatever the compute
  dtype: with lse = logsumexp_i(lse_i), out = sum_i exp(lse_i - lse) * out_i (kept as a
  running pair, so one partial output is alive at a time).
- :class:`USP`: Ulysses and ring on the same ranks, in yunchang's layout: the Ulysses groups
  are consecutive ranks, the ring groups are strided by the Ulysses degree. Sequence-parallel
  rank s = r * ulysses + u holds token chunk s. The Ulysses all-to-all gives each rank the
  tokens of its whole Ulysses group (ring block r, contiguous) for 1/ulysses of the heads;
  ring attention runs over the ring group for those heads; the reverse all-to-all returns
  this rank's tokens, all heads.

DiT self-attention is bidirectional: no causal mask, so no load balancing of the blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .split import TokenSplit
from .ulysses import Ulysses


def block_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """softmax(q k^T * scale) v for one key block and its log-sum-exp, both float32:
    (B, H, n, D) x (B, H, m, D) -> out (B, H, n, D), lse (B, H, n, 1)."""
    f32 = np.float32
    scores = np.matmul(q.astype(f32, copy=False), np.swapaxes(k.astype(f32, copy=False), -1, -2))
    scores *= f32(scale)
    m = scores.max(axis=-1, keepdims=True)
    scores -= m
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v.astype(f32, copy=False))
    out /= total
    return out, m + np.log(total)


def merge(out: np.ndarray | None, lse: np.ndarray | None, out_i: np.ndarray, lse_i: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """Merge a block's (out_i, lse_i) into the running (out, lse), in float32, in place."""
    if out is None or lse is None:
        return out_i, lse_i
    new = np.logaddexp(lse, lse_i)
    out *= np.exp(lse - new)
    out += np.exp(lse_i - new) * out_i
    return out, new


class Ring:
    """Ring attention over one group (see the module docstring). Arrays are NumPy."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.degree = int(group.size)
        self.rank = int(group.rank)
        self._kv: dict[tuple[Any, ...], list[np.ndarray]] = {}

    def __repr__(self) -> str:
        return f"Ring(degree={self.degree}, rank={self.rank})"

    def _buffers(self, shape: tuple[int, ...], dtype: np.dtype) -> list[np.ndarray]:
        # two k/v buffers per shape, reused: one is sent and computed on, the other received
        key = (shape, np.dtype(dtype).str)
        if key not in self._kv:
            self._kv = {key: [np.empty(shape, dtype), np.empty(shape, dtype)]}  # one shape at a time
        return self._kv[key]

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None = None) -> np.ndarray:
        """Attention of this rank's (B, H, n, D) queries over the keys and values of every
        rank of the ring (each (B, H, n, D), the same n on every rank): (B, H, n, D) float32."""
        if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"ring attention: incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
        scale = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else scale
        p = self.degree
        if p == 1:
            return block_attention(q, k, v, scale)[0]
        cur, nxt = self._buffers((2, *k.shape), np.result_type(k.dtype, v.dtype))
        cur[0], cur[1] = k, v
        dest, source = (self.rank + 1) % p, (self.rank - 1) % p
        out = lse = None
        for step in range(p):
            if step < p - 1:  # the next block moves while this one is computed
                self.group.sendrecv_start(cur, dest, nxt, source)
            try:
                out_i, lse_i = block_attention(q, cur[0], cur[1], scale)
            finally:
                if step < p - 1:
                    self.group.sendrecv_wait()
            out, lse = merge(out, lse, out_i, lse_i)
            cur, nxt = nxt, cur
        assert out is not None
        return out


class USP(TokenSplit):
    """Ulysses x ring sequence parallelism (either may be None: degree 1) with the interface
    :class:`~hsdp.parallel.Ulysses` gives the reference model: tokens split over
    ``degree = ulysses * ring`` ranks, each self-attention over the whole sequence."""

    _split_name = "sequence parallel (ulysses x ring)"

    def __init__(self, group: Any, ulysses: Ulysses | None, ring: Ring | None) -> None:
        self.group = group  # every sequence-parallel rank, ordered s = r * ulysses + u
        self.ulysses = ulysses
        self.ring = ring
        self.degree = int(group.size)
        self.rank = int(group.rank)
        u = ulysses.degree if ulysses else 1
        r = ring.degree if ring else 1
        if u * r != self.degree:
            raise ValueError(f"USP: ulysses {u} x ring {r} != the sequence-parallel group's {self.degree} ranks")

    def __repr__(self) -> str:
        return f"USP(ulysses={self.ulysses}, ring={self.ring}, rank={self.rank})"

    def check_heads(self, num_heads: int) -> None:
        if self.ulysses is not None:
            self.ulysses.check_heads(num_heads)

    def grouped(self, b: int, n: int, h: int, d: int, dtype: Any) -> np.ndarray:
        if self.ulysses is not None:
            return self.ulysses.grouped(b, n, h, d, dtype)
        return np.empty((b, n, 1, h * d), dtype)  # the same view shape Ulysses.grouped gives for 1 rank

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                sdpa: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        return self.ring.attention(q, k, v) if self.ring is not None else sdpa(q, k, v)

    def attention_grouped(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, head_dim: int,
                          sdpa: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        if self.ulysses is not None:
            heads = [self.ulysses._to_heads_grouped(t, head_dim) for t in (q, k, v)]
            return self.ulysses._to_tokens(self._attend(*heads, sdpa))
        b, n = q.shape[:2]
        heads = [t.reshape(b, n, -1, head_dim).transpose(0, 2, 1, 3) for t in (q, k, v)]
        return self._attend(*heads, sdpa)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  sdpa: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        if self.ulysses is not None:
            self.ulysses.check_heads(q.shape[1])
            out = self._attend(self.ulysses._to_heads(q), self.ulysses._to_heads(k), self.ulysses._to_heads(v), sdpa)
            return self.ulysses._to_tokens(out)
        return self._attend(q, k, v, sdpa)
