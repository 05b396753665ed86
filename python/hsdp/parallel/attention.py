"""Sequence-parallel attention behind diffusers' dispatcher: Ulysses, ring and both (USP) over
hsdp's groups, on torch tensors (CPU ranks over MPI, GPUs over NCCL).

:class:`SequenceParallelAttention` is what :mod:`hsdp.parallel.context` sets as every attention
processor's ``_parallel_config``. diffusers' processors pass that object to
``dispatch_attention_fn`` for exactly the calls its context-parallel design covers (a Wan
cross-attention passes None: its keys are the text, whole on every rank), and hsdp's router
(:func:`hsdp.parallel.context.route`) sends those calls here. Layout in and out is the
dispatcher's: (batch, tokens, heads, head_dim), this rank's tokens.

- **Ulysses** (``ulysses > 1``): an all-to-all turns (my tokens, every head) into (every token
  of my Ulysses group, my heads); the stock dispatcher (the user's backend) computes attention
  over them; the reverse all-to-all returns my tokens, every head.
- **Ring** (``ring > 1``): the key/value block of each ring rank passes around the ring by
  send/recv while the current block's attention runs; the partial results merge through
  their log-sum-exp. [Note: ring precision] Each block's attention is computed from float32
  inputs (a bfloat16 widens exactly) and the merge runs in float32, so the result is rounded
  once, at the end, as unsharded attention rounds it. A half-precision kernel rounds each
  block's output; that one ulp per block grew to 1.3% of the latents over layers and steps.
- **Uneven tokens.** The plan's splits are ``tensor_split``'s (the first ranks hold one token
  more), so ranks may hold different token counts. [Note: lengths] When every split of this
  forward divided evenly (the common case), every rank holds the same count and nothing is
  exchanged; otherwise each attention call all-gathers the (query, key) counts of its group
  (two integers). The all-to-alls and the ring's buffers are padded to the longest rank, and
  the padding is cut off before attention: padded positions are never keys.
- **Masks.** A key mask (its query dimension 1: a padding mask, boolean or additive) is
  all-gathered along its key dimension, so each key keeps its own entry; a mask that depends
  on the query is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..adapters.torch import TorchAdapter, _on_device, outside_graphs
from ..adapters.torch import as_numpy as _np

_TORCH = TorchAdapter()


# ------------------------------------------------------------------------------------ blocks


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + bias) v over one key block, and its log-sum-exp (B, H, n, 1),
    both float32, from (B, H, n, D) queries and (B, H, m, D) keys and values (see [Note: ring
    precision] above). A row whose keys are all masked has out 0 and lse -1e30: it weighs
    nothing in the merge."""
    q, k, v = q.float(), k.float(), v.float()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if bias is None:
        try:
            if q.device.type == "cpu":
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[:2]
                return out, lse.unsqueeze(-1)
            if q.is_cuda:  # UNTESTED ON A GPU: float32 takes the memory-efficient kernel, not flash
                out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)[:2]
                return out, lse[..., : q.shape[2]].unsqueeze(-1)  # its lse rows may be padded
        except (RuntimeError, NotImplementedError):  # a shape or build it does not take: the math below
            pass
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1, keepdim=True).clamp_min(-1e30)  # all masked: -inf -> a finite floor
    return torch.matmul(torch.exp(scores - lse), v), lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, out_i: torch.Tensor, lse_i: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (out, lse) with one more block: out = sum_i exp(lse_i - lse) out_i."""
    if out is None or lse is None:
        return out_i, lse_i
    new = torch.logaddexp(lse, lse_i)
    return out * torch.exp(lse - new) + out_i * torch.exp(lse_i - new), new


def _as_bias(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True: attend) as an additive float32 bias; an additive one as float32."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, -math.inf)
    return mask.float()


# ------------------------------------------------------------------------------------ exchanges


def _pad_tokens(t: torch.Tensor, to: int) -> torch.Tensor:
    # (B, n, ...) -> (B, to, ...), zeros after
    n = t.shape[1]
    if n == to:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], to - n, *t.shape[2:]))], dim=1)


def all_gather_tokens(group: Any, t: torch.Tensor, lens: list[int], dim: int = 1) -> torch.Tensor:
    """Every rank's piece of `t` along `dim` (rank i's being lens[i] long), whole, in rank order."""
    longest = max(lens)
    moved = t.movedim(dim, 1)
    recv = _TORCH.all_gather(group, _pad_tokens(moved, longest))  # (P, B, longest, ...)
    if all(n == longest for n in lens):
        whole = recv.movedim(0, 1).reshape(recv.shape[1], len(lens) * longest, *recv.shape[3:])
    else:
        whole = torch.cat([recv[i, :, :n] for i, n in enumerate(lens)], dim=1)
    return whole.movedim(1, dim)


def to_heads(group: Any, t: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Ulysses before attention: my (B, n, H, D) tokens -> (B, sum(lens), H / U, D), every token
    of the group for head group `group.rank`. Block j of the send is head group j."""
    u = group.size
    b, _, h, d = t.shape
    longest = max(lens)
    send = _pad_tokens(t, longest).reshape(b, longest, u, h // u, d).permute(2, 0, 1, 3, 4)
    recv = _TORCH.all_to_all(group, send)  # (U, B, longest, H/U, D): block i is rank i's tokens
    if all(n == longest for n in lens):
        return recv.permute(1, 0, 2, 3, 4).reshape(b, u * longest, h // u, d)
    return torch.cat([recv[i, :, :n] for i, n in enumerate(lens)], dim=1)


def to_tokens(group: Any, t: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Ulysses after attention, the reverse of :func:`to_heads`: (B, sum(lens), H / U, D) ->
    my (B, lens[rank], H, D)."""
    u = group.size
    b, _, hp, d = t.shape
    longest = max(lens)
    if all(n == longest for n in lens):
        send = t.reshape(b, u, longest, hp, d).transpose(0, 1)
    else:
        send = torch.stack([_pad_tokens(p, longest) for p in t.split(lens, dim=1)])
    recv = _TORCH.all_to_all(group, send)  # (U, B, longest, H/U, D): block i is head group i of my tokens
    mine = lens[group.rank]
    return recv[:, :, :mine].permute(1, 2, 0, 3, 4).reshape(b, mine, u * hp, d)


def ring_attention(ring: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   lens: list[int] | None = None, bias_of: Callable[[int], torch.Tensor | None] | None = None
                   ) -> torch.Tensor:
    """This rank's (B, H, n, D) queries over every ring rank's keys and values (rank i's being
    lens[i] long; None: all as long as k): (B, H, n, D) float32. One buffer holds a k/v block;
    the next one moves (MPI worker, NCCL side stream) while this one is computed. `bias_of(i)`
    is the additive mask of rank i's keys, or None."""
    p, me = ring.degree, ring.rank
    lens = lens or [k.shape[2]] * p
    if p == 1:
        return block_attention(q, k, v, scale, bias_of(0) if bias_of else None)[0]
    longest = max(lens)
    b, h, _, d = k.shape
    # past a shorter block the buffer holds stale bytes: they travel, and are never read
    bufs = [torch.empty((2, b, h, longest, d), dtype=k.dtype, device=k.device) for _ in range(2)]
    cur, nxt = bufs
    cur[0, :, :, : k.shape[2]].copy_(k)
    cur[1, :, :, : v.shape[2]].copy_(v)
    dest, source = (me + 1) % p, (me - 1) % p
    out = lse = None
    for step in range(p):
        if step < p - 1:  # the next block moves while this one is computed
            if _on_device(ring.group, cur):  # the group's device, as the adapter's exchanges ask
                ring.group.sendrecv_start_device(cur.data_ptr(), dest, nxt.data_ptr(), source,
                                                 cur.numel() * cur.element_size())
            else:
                ring.group.sendrecv_start(_np(cur), dest, _np(nxt), source)
        owner = (me - step) % p  # whose keys `cur` holds
        n = lens[owner]
        try:
            out_i, lse_i = block_attention(q, cur[0, :, :, :n], cur[1, :, :, :n], scale,
                                           bias_of(owner) if bias_of else None)
        finally:
            if step < p - 1:
                ring.group.sendrecv_wait()
        out, lse = merge(out, lse, out_i, lse_i)
        cur, nxt = nxt, cur
    assert out is not None
    return out


# ------------------------------------------------------------------------------------ the call


class SequenceParallelAttention:
    """Attention over the whole sequence from this rank's tokens, over `sp` (a
    :class:`~hsdp.parallel.Ulysses` or a :class:`hsdp.ring.USP`); set as each attention
    processor's ``_parallel_config`` (see the module docstring). ``even`` is True while every
    split of the current forward divided evenly (:class:`hsdp.parallel.context.PlanHooks`
    keeps it); ``calls`` counts the calls routed here in this forward."""

    def __init__(self, sp: Any, stock: Callable[..., torch.Tensor]) -> None:
        from .ring import USP

        self.sp = sp
        self.stock = stock  # diffusers' own dispatch_attention_fn, for the attention itself
        self.ulysses = sp.ulysses if isinstance(sp, USP) else sp
        self.ring = sp.ring if isinstance(sp, USP) else None
        self.even = True
        self.calls = 0

    def __repr__(self) -> str:
        return f"SequenceParallelAttention({self.sp!r})"

    def _lengths(self, nq: int, nk: int, like: torch.Tensor) -> tuple[list[int], list[int]]:
        """Every sequence-parallel rank's (query, key) token counts, in sp rank order."""
        p = self.sp.degree
        if self.even:
            return [nq] * p, [nk] * p
        mine = torch.tensor([nq, nk], dtype=torch.int64, device=like.device)
        every = _TORCH.all_gather(self.sp.group, mine).cpu().tolist()
        return [int(x[0]) for x in every], [int(x[1]) for x in every]

    def _key_mask(self, mask: torch.Tensor, heads: int, lens_k: list[int]) -> torch.Tensor:
        """This rank's key mask (..., 1, n_k) -> the whole sequence's (B, h, 1, N_k), its heads
        narrowed to this rank's Ulysses head group."""
        m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)) if mask.ndim < 4 else mask
        if m.ndim != 4 or m.shape[-2] != 1:
            raise NotImplementedError(
                f"sequence parallel attention takes a key mask (its query dimension 1), got a mask of shape "
                f"{tuple(mask.shape)}; a mask that depends on the query is not built")
        m = all_gather_tokens(self.sp.group, m.contiguous(), lens_k, dim=3)
        if self.ulysses is not None and m.shape[1] == heads:
            hp = heads // self.ulysses.degree
            m = m[:, self.ulysses.rank * hp : (self.ulysses.rank + 1) * hp]
        return m

    # Eager under torch.compile, a graph break around each sequence-parallel attention call
    # ([Note: compile] in hsdp.adapters.torch): its exchanges hand tensors' bytes to the group,
    # and its counts (calls, even) are per-forward state no graph may freeze.
    @outside_graphs
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, enable_gqa: bool = False, backend: Any = None) -> torch.Tensor:
        if is_causal:
            raise NotImplementedError("sequence parallel attention with is_causal=True is not built "
                                      "(diffusion transformers attend both ways)")
        if dropout_p:
            raise NotImplementedError(f"sequence parallel attention runs inference only: dropout_p={dropout_p}")
        self.calls += 1
        heads = query.shape[2]
        if key.shape[2] != heads:  # grouped-query attention: every query head its key head, exactly
            if not enable_gqa or heads % key.shape[2]:
                raise ValueError(f"sequence parallel attention: {heads} query heads and {key.shape[2]} key heads")
            rep = heads // key.shape[2]
            key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        uly, ring = self.ulysses, self.ring
        if uly is not None:
            uly.check_heads(heads)
        lens_q, lens_k = self._lengths(query.shape[1], key.shape[1], query)
        mask = self._key_mask(attn_mask, heads, lens_k) if attn_mask is not None else None
        u = uly.degree if uly is not None else 1
        r = ring.rank if ring is not None else 0
        group_q = lens_q[r * u : (r + 1) * u]  # my Ulysses group's ranks are sp ranks r*U .. r*U+U-1
        group_k = lens_k[r * u : (r + 1) * u]
        if uly is not None:
            query, key, value = (to_heads(uly.group, query, group_q), to_heads(uly.group, key, group_k),
                                 to_heads(uly.group, value, group_k))
        if ring is None:
            out = self.stock(query, key, value, attn_mask=mask, scale=scale, backend=backend)
        else:
            blocks = [sum(lens_k[i * u : (i + 1) * u]) for i in range(ring.degree)]  # each ring rank's keys
            starts = [sum(blocks[:i]) for i in range(ring.degree)]
            bias = _as_bias(mask) if mask is not None else None

            def bias_of(i: int) -> torch.Tensor | None:
                return None if bias is None else bias[..., starts[i] : starts[i] + blocks[i]]

            out = ring_attention(ring, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale,
                                 blocks, bias_of).transpose(1, 2).to(query.dtype)
        if uly is not None:
            out = to_tokens(uly.group, out.contiguous(), group_q)
        return out
