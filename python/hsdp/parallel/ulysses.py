"""The Ulysses exchange: (my tokens, every head) <-> (every token, my heads) by
all-to-all around self-attention (the layout: docs/design.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .split import TokenSplit

if TYPE_CHECKING:
    from ..adapters import TensorAdapter


class _Kept:
    """An exchange buffer Ulysses keeps for reuse, and whether a lease on it is out."""

    __slots__ = ("array", "leased")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.leased = False


class _Lease:
    """One hand-out of a kept buffer ([Note: leases] in docs/design.md): the base of the array
    made from it, so of every view of that array, so it lives exactly as long as any of them
    does; its end returns the buffer. No reference count is read."""

    __slots__ = ("_kept",)

    def __init__(self, kept: _Kept) -> None:
        self._kept = kept
        kept.leased = True

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self._kept.array.__array_interface__

    def __del__(self) -> None:
        self._kept.leased = False


class Ulysses(TokenSplit):
    """Ulysses sequence parallelism over one group: token splitting and the attention exchange.

    Arrays are NumPy, C-contiguous after each exchange. The group's all-to-all is the
    backend's (MPI: ``MPI_Alltoall``, GIL released)."""

    _split_name = "Ulysses sequence parallel"
    _degree_label = "ulysses_degree="

    def __init__(self, group: Any) -> None:
        self.group = group
        self.degree = int(group.size)
        self.rank = int(group.rank)
        self._buffers: dict[tuple[Any, ...], list[_Kept]] = {}

    def __repr__(self) -> str:
        return f"Ulysses(degree={self.degree}, rank={self.rank})"

    def check_heads(self, num_heads: int) -> None:
        if num_heads % self.degree:
            raise ValueError(
                f"Ulysses sequence parallel splits the attention heads across its ranks: num_heads={num_heads} "
                f"is not divisible by ulysses_degree={self.degree}; choose a degree that divides {num_heads}"
            )

    def _buffer(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A send or receive buffer of this shape, leased: reused once every view of the last
        hand-out of it is gone (a result still in use holds its lease through its views'
        .base). A fresh array per exchange would be allocated and faulted in each time,
        costing more than the transfer."""
        key = (shape, np.dtype(dtype).str)
        kept = self._buffers.setdefault(key, [])
        for k in kept:
            if not k.leased:
                return np.asarray(_Lease(k))
        k = _Kept(np.empty(shape, dtype))
        if len(kept) < 4:
            kept.append(k)
        return np.asarray(_Lease(k))

    def _to_heads(self, t: np.ndarray) -> np.ndarray:
        # (B, H, n, D), my tokens -> (B, H / degree, N, D), my heads. The model's q, k and v
        # are (B, n, H, D) projections seen as (B, H, n, D): block j of the send (head group
        # j, rank j's) is then B*n rows of H/degree*D values, a stride of H*D apart, and MPI
        # packs them inside the transfer. Block i of the recv is rank i's tokens,
        # (B, n, H / degree, D); for B = 1 the result is a strided view of it, which the
        # matrix products read as is.
        b, h, n, d = t.shape
        p = self.degree
        hp, item = h // p, t.itemsize
        tokens = t.transpose(0, 2, 1, 3)
        if not tokens.flags.c_contiguous:  # any other layout: one packing copy into the grouped one
            grouped = tokens.reshape(b, n, p, hp * d).transpose(2, 0, 1, 3)
            return self._exchange_grouped(np.ascontiguousarray(grouped), d)
        recv = self._buffer((p, b, n, hp, d), t.dtype)
        block = b * n * hp * d * item
        self.group.all_to_all_blocks(tokens, (hp * d * item, hp * d * item, ((b * n, h * d * item),)),
                                     recv, (block, block, ()))
        return self._as_heads(recv)

    def _as_heads(self, recv: np.ndarray) -> np.ndarray:
        # recv (degree, B, n, H / degree, D), block i being rank i's tokens -> (B, H / degree, N, D)
        p, b, n, hp, d = recv.shape
        return recv.transpose(1, 3, 0, 2, 4).reshape(b, hp, p * n, d)

    def _exchange_grouped(self, send: np.ndarray, d: int) -> np.ndarray:
        # send (degree, B, n, H / degree * D), contiguous: block j goes to rank j as it lies
        p, b, n, hpd = send.shape
        recv = self._buffer((p, b, n, hpd // d, d), send.dtype)
        self.group.all_to_all(send, recv)
        return self._as_heads(recv)

    def grouped(self, b: int, n: int, h: int, d: int, dtype: Any) -> np.ndarray:
        """Where a (B, n, H * D) projection is best written: a (B, n, degree, H / degree * D)
        view of a reused (degree, B, n, H / degree * D) buffer, head group j's block being what
        rank j receives, so the exchange sends it as it lies. A projection writes here in a
        pass it makes anyway (``out=`` of ``hsdp.nn.functional.linear`` and ``rms_norm``):
        its division or bias add, reading each token's row in head-group parts."""
        self.check_heads(h)
        p = self.degree
        return self._buffer((p, b, n, h // p * d), dtype).transpose(1, 2, 0, 3)

    def _to_heads_grouped(self, t: np.ndarray, d: int) -> np.ndarray:
        # A view from grouped(): its buffer is the send as it lies, block j for rank j.
        send = t.transpose(2, 0, 1, 3) if t.ndim == 4 else t
        if t.ndim != 4 or t.shape[2] != self.degree or not send.flags.c_contiguous or t.shape[3] % d:
            raise ValueError(f"Ulysses: an array of shape {t.shape} is not a head-group-major view from "
                             f"Ulysses.grouped (degree {self.degree}, head dim {d})")
        return self._exchange_grouped(send, d)

    def _to_tokens(self, t: np.ndarray) -> np.ndarray:
        # (B, H / degree, N, D) -> (B, H, n, D), as a view of a token-major (B, n, H, D) array
        # (what the output projection reads). Block j of the send is rank j's tokens for my
        # heads, taken (b, token, head) in place; block i of the recv lands at head group i
        # of my tokens in place: no copy on either side.
        t = np.ascontiguousarray(t)
        b, hp, total, d = t.shape
        p = self.degree
        n, item = total // p, t.itemsize
        h = hp * p
        recv = self._buffer((b, n, h, d), t.dtype)
        send_layout = (d * item, n * d * item, ((b, hp * total * d * item), (n, d * item), (hp, total * d * item)))
        recv_layout = (hp * d * item, hp * d * item, ((b * n, h * d * item),))
        self.group.all_to_all_blocks(t, send_layout, recv, recv_layout)
        return recv.transpose(0, 2, 1, 3)

    def heads(self, t: Any, adapter: TensorAdapter) -> Any:
        """The exchange before attention, in ``adapter``'s tensors: this rank's tokens, every
        head, (B, n, H, D) -> every token, this rank's H / degree heads, (B, H / degree, N, D).
        Block j of the send is head group j of my tokens; block i of the recv is rank i's
        tokens for my heads. (The NumPy model takes the zero-copy path of :meth:`attention`,
        the same layout packed in the transfer.)"""
        b, n, h, d = t.shape
        p = self.degree
        recv = adapter.all_to_all(self.group, adapter.permute(t.reshape(b, n, p, h // p, d), (2, 0, 1, 3, 4)))
        return adapter.permute(recv, (1, 3, 0, 2, 4)).reshape(b, h // p, p * n, d)

    def tokens(self, t: Any, adapter: TensorAdapter) -> Any:
        """The exchange after attention, the reverse of :meth:`heads`: (B, H / degree, N, D)
        -> this rank's tokens, every head, (B, n, H * D). Block j of the send is rank j's
        tokens for my heads; block i of the recv is head group i of my tokens."""
        b, hp, total, d = t.shape
        p = self.degree
        n = total // p
        recv = adapter.all_to_all(self.group, adapter.permute(t.reshape(b, hp, p, n, d), (2, 0, 3, 1, 4)))
        return adapter.permute(recv, (1, 2, 0, 3, 4)).reshape(b, n, p * hp * d)

    def attention(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, sdpa: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    ) -> np.ndarray:
        """Self-attention over the whole sequence from each rank's (B, H, n, D) q, k, v: the
        result is this rank's tokens, all heads, as unsharded attention computes them."""
        self.check_heads(q.shape[1])
        out = sdpa(self._to_heads(q), self._to_heads(k), self._to_heads(v))
        return self._to_tokens(out)

    def attention_grouped(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, head_dim: int,
        sdpa: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
    ) -> np.ndarray:
        """``attention`` for q, k, v written into ``grouped`` views (the reference model's
        path): the same result, as (B, H, n, D), with no packing before the exchange."""
        heads = [self._to_heads_grouped(t, head_dim) for t in (q, k, v)]
        return self._to_tokens(sdpa(*heads))
