"""Sequence (Ulysses) and CFG parallelism, over the ranks ``DiffusionParallelConfig`` lays out.

Rank layout (HSDP adds no ranks; it shards over these same ones, see docs/launching.md):

    world = cfg x ring x ulysses, ulysses innermost:  rank = c * (ring * ulysses) + r * ulysses + u
    sequence-parallel group of a rank: the ranks with its c   (consecutive ranks; s = r * ulysses + u)
    Ulysses group:                     the ranks with its c, r (consecutive ranks)
    ring group:                        the ranks with its c, u (strided by ulysses: yunchang's layout)
    CFG group of a rank:               the ranks with its s   (one per branch)

- **Ulysses.** Each rank of a sequence-parallel group holds 1/ulysses of the tokens. Before
  self-attention an all-to-all turns (my tokens, all heads) into (all tokens, my heads);
  attention runs over the whole sequence for those heads; a second all-to-all turns the
  result back. Everything else in a block is token-wise and runs on the local tokens.
  Cross-attention needs no exchange: its keys are the text, whole on every rank.
- **CFG.** The two halves of a CFG group compute the conditional and the unconditional
  branch; the noise predictions are all-gathered, so every rank applies the same guidance.
- **Ring** (``ring_degree > 1``, :mod:`hsdp.ring`): each rank of a ring group keeps its
  queries; the key/value blocks pass around the ring by send/recv and the partial results
  merge through the softmax log-sum-exp. With Ulysses too (USP) the all-to-all runs first,
  ring attention inside, then the reverse all-to-all. ``ParallelGroups.sp`` is then a
  :class:`hsdp.ring.USP`, with the interface of :class:`Ulysses` the reference model uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .adapters import NUMPY

if TYPE_CHECKING:
    from .adapters import TensorAdapter


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


class TokenSplit:
    """Tokens split evenly over a sequence-parallel group (``group``, ``degree``, ``rank``),
    shared by :class:`Ulysses` and :class:`hsdp.ring.USP`; ``_split_name`` names the split
    in errors."""

    group: Any
    degree: int
    rank: int
    _split_name = "sequence parallel"
    _degree_label = ""  # before the degree in errors

    def local_tokens(self, total: int) -> int:
        """Tokens per rank for a sequence of `total` tokens (ValueError when it does not divide)."""
        if total % self.degree:
            raise ValueError(
                f"{self._split_name} gives each of its {self.degree} ranks an equal share of the tokens: {total} "
                f"tokens are not divisible by {self._degree_label}{self.degree}; change the frames, height or width so that the "
                f"number of patches is a multiple of {self.degree}"
            )
        return total // self.degree

    def split_tokens(self, x: np.ndarray) -> np.ndarray:
        """(B, N, C) -> this rank's (B, N / degree, C): tokens [rank * n, (rank + 1) * n)."""
        n = self.local_tokens(x.shape[1])
        return np.ascontiguousarray(x[:, self.rank * n : (self.rank + 1) * n])

    def gather_tokens(self, x: Any, adapter: TensorAdapter | None = None) -> Any:
        """Every rank's (B, n, ...) -> the whole (B, degree * n, ...), in rank order, in
        ``adapter``'s tensors (None: NumPy arrays)."""
        ad = adapter or NUMPY
        recv = ad.all_gather(self.group, x)  # (degree, B, n, ...)
        b, n, *rest = x.shape
        return ad.permute(recv, (1, 0, *range(2, recv.ndim))).reshape(b, self.degree * n, *rest)


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


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """The sequence-parallel and CFG groups of this rank (None where the degree is 1)."""

    ulysses_degree: int
    cfg_degree: int
    ulysses_rank: int
    cfg_rank: int
    sp: Any | None  # Ulysses, or hsdp.ring.USP when ring_degree > 1
    cfg: Any | None
    ring_degree: int = 1
    ring_rank: int = 0

    @property
    def combined(self) -> bool:
        return self.ulysses_degree > 1 or self.cfg_degree > 1 or self.ring_degree > 1

    def describe(self) -> str:
        parts = []
        if self.ulysses_degree > 1:
            parts.append(f"ulysses {self.ulysses_rank}/{self.ulysses_degree}")
        if self.ring_degree > 1:
            parts.append(f"ring {self.ring_rank}/{self.ring_degree}")
        if self.cfg_degree > 1:
            parts.append(f"cfg branch {self.cfg_rank}/{self.cfg_degree}")
        return ", ".join(parts) or "no sequence or CFG parallelism"


SINGLE = ParallelGroups(ulysses_degree=1, cfg_degree=1, ulysses_rank=0, cfg_rank=0, sp=None, cfg=None)
"""One rank computing everything: no sequence split, both CFG branches here."""


def init_parallel_groups(config: Any, world: Any) -> ParallelGroups:
    """Split `world` into the sequence-parallel and CFG groups `config` (a
    ``DiffusionParallelConfig``) declares. Collective: every rank calls it."""
    ring = config.ring_degree
    if ring > 1:
        return _init_usp_groups(config, world)
    sp, cfg = config.ulysses_degree, config.cfg_parallel_size
    config.check_world(world.size)  # ValueError naming both sizes and the launch command
    if sp * cfg == 1:  # standalone HSDP, or nothing parallel: no group to split off
        return SINGLE
    config.require_supported()  # NotImplementedError naming each degree hsdp.built lists as not built
    u, c = world.rank % sp, world.rank // sp
    # Both splits on every rank, in this order: a split is a collective over the world.
    sp_group = world.split(color=c, key=u)
    cfg_group = world.split(color=u, key=c)
    return ParallelGroups(
        ulysses_degree=sp,
        cfg_degree=cfg,
        ulysses_rank=u,
        cfg_rank=c,
        sp=Ulysses(sp_group) if sp > 1 else None,
        cfg=cfg_group if cfg > 1 else None,
    )


def _init_usp_groups(config: Any, world: Any) -> ParallelGroups:
    """The groups of ring_degree > 1, alone or with Ulysses and CFG (the layout above)."""
    from .ring import USP, Ring

    uly, ring, cfg = config.ulysses_degree, config.ring_degree, config.cfg_parallel_size
    sp = uly * ring
    config.check_world(world.size)
    config.require_supported()  # NotImplementedError naming each degree hsdp.built lists as not built
    s, c = world.rank % sp, world.rank // sp
    u, r = s % uly, s // uly
    # Every split on every rank, in this order: each is a collective over the world.
    sp_group = world.split(color=c, key=s)
    uly_group = world.split(color=c * ring + r, key=u)
    ring_group = world.split(color=c * uly + u, key=r)
    cfg_group = world.split(color=s, key=c)
    usp = USP(sp_group, Ulysses(uly_group) if uly > 1 else None, Ring(ring_group))
    return ParallelGroups(
        ulysses_degree=uly,
        cfg_degree=cfg,
        ulysses_rank=u,
        cfg_rank=c,
        sp=usp,
        cfg=cfg_group if cfg > 1 else None,
        ring_degree=ring,
        ring_rank=r,
    )


def apply_sequence_parallel(model: Any, sp: Any) -> Any:
    """Make a reference :class:`~hsdp.models.VideoDiT` run its tokens split over `sp` (a
    :class:`Ulysses`, or a :class:`hsdp.ring.USP` for ring attention): the
    model splits them after the patch embedding, every self-attention exchanges them, and
    the output is gathered whole on every rank. ``None`` turns it off. Returns the model."""
    from .models.dit import Attention, VideoDiT

    if not isinstance(model, VideoDiT):
        raise TypeError(
            f"apply_sequence_parallel takes a reference hsdp.models.VideoDiT, got {type(model).__name__}; "
            "for a diffusers Wan transformer use hsdp.parallel_torch.apply_sequence_parallel_torch"
        )
    if sp is not None:
        sp.check_heads(model.config.num_heads)
    object.__setattr__(model, "_hsdp_ulysses", sp)
    for block in model.blocks:
        attn = block.self_attn
        assert isinstance(attn, Attention)
        object.__setattr__(attn, "_hsdp_ulysses", sp)
    return model


def cfg_combine(
    groups: ParallelGroups, branch: Callable[[int], Any], guidance_scale: float, adapter: TensorAdapter | None = None
) -> Any:
    """Classifier-free guidance, uncond + scale * (cond - uncond) in float32, the same on
    every rank, in ``adapter``'s tensors (None: NumPy arrays; ``hsdp.parallel_torch`` passes
    the torch adapter).

    `branch(0)` computes the conditional prediction and `branch(1)` the unconditional one.
    With a CFG group each rank computes its own branch and the two are all-gathered; without
    one this rank computes both."""
    ad = adapter or NUMPY
    if groups.cfg is None:
        cond, uncond = ad.to_float32(branch(0)), ad.to_float32(branch(1))
    else:
        both = ad.all_gather(groups.cfg, ad.to_float32(branch(groups.cfg_rank)))
        cond, uncond = both[0], both[1]
    # a Python float: the product stays float32 in both frameworks
    return ad.to_float32(uncond + float(guidance_scale) * (cond - uncond))
