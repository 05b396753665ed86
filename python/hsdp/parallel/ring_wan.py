"""Ring attention and USP for diffusers' Wan transformers (torch; CPU ranks over MPI, or GPUs over NCCL).

:class:`USPWanAttnProcessor` is the drop-in for diffusers' ``WanAttnProcessor`` that
:func:`hsdp.parallel_torch.apply_sequence_parallel_torch` installs when its group is a
:class:`hsdp.ring.USP` (``ring_degree > 1``): the Ulysses all-to-all (when ulysses > 1),
ring attention over the ring group, the reverse all-to-all. The ring passes one k/v buffer
per step by the group's ``sendrecv_start``/``sendrecv_wait`` (the MPI worker moves it while
this block's attention runs) and merges the partial results through their log-sum-exp in
float32. A block's attention and its log-sum-exp come from torch's flash attention (CPU:
``aten._scaled_dot_product_flash_attention_for_cpu``; CUDA, half precision:
``aten._scaled_dot_product_flash_attention``), else from explicit float32 math.

On GPUs (the NCCL backend) the k/v block moves by ``sendrecv_start_device``: grouped
``ncclSend``/``ncclRecv`` on hsdp's side stream, the compute stream made to wait at
``sendrecv_wait``. That path has NOT RUN ON A GPU yet (no GPU was lent to the project); it
runs against the fake CUDA/NCCL library between forked ranks, on CPU tensors
(tests/nccl_torch_fake.py), so no CUDA stream is involved. Imported only by callers, so
``import hsdp`` never pulls torch in.
"""

from __future__ import annotations

import math

import torch

from ..adapters.torch import _on_device
from ..adapters.torch import as_numpy as _np
from .ulysses_wan import _TORCH, WanSelfAttnProcessor
from .ring import Ring


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(D)) v over one key block, and its log-sum-exp (B, H, n, 1), both float32."""
    if q.device.type == "cpu":
        flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    elif q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
    else:
        flash = None
    if flash is not None:
        try:
            out, lse = flash(q, k, v)[:2]  # both ops: (output, logsumexp (B, H, n) float32, ...)
            return out.float(), lse.float().unsqueeze(-1)
        except (RuntimeError, NotImplementedError):  # a dtype or shape it does not take: the math below
            pass
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v.float()), lse


def ring_attention(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """This rank's (B, H, n, D) queries over every ring rank's keys and values (see
    :class:`hsdp.ring.Ring`): (B, H, n, D) float32."""
    p = ring.degree
    if p == 1:
        return block_attention(q, k, v)[0]
    bufs = [torch.empty((2, *k.shape), dtype=k.dtype, device=k.device) for _ in range(2)]
    cur, nxt = bufs
    cur[0].copy_(k)
    cur[1].copy_(v)
    dest, source = (ring.rank + 1) % p, (ring.rank - 1) % p
    out = lse = None
    for step in range(p):
        if step < p - 1:  # the next block moves (MPI worker, NCCL side stream) while this one is computed
            if _on_device(ring.group, cur):  # the group's device, as the adapter's exchanges ask
                nbytes = cur.numel() * cur.element_size()
                ring.group.sendrecv_start_device(cur.data_ptr(), dest, nxt.data_ptr(), source, nbytes)
            else:
                ring.group.sendrecv_start(_np(cur), dest, _np(nxt), source)
        try:
            out_i, lse_i = block_attention(q, cur[0], cur[1])
        finally:
            if step < p - 1:
                ring.group.sendrecv_wait()
        if out is None or lse is None:
            out, lse = out_i, lse_i
        else:  # out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i, as a running pair
            new = torch.logaddexp(lse, lse_i)
            out = out * torch.exp(lse - new) + out_i * torch.exp(lse_i - new)
            lse = new
        cur, nxt = nxt, cur
    assert out is not None
    return out


class USPWanAttnProcessor(WanSelfAttnProcessor):
    """Self-attention over the whole sequence, the tokens split over a USP group's ranks
    (Ulysses x ring); cross-attention keeps the stock processor (its keys are the text)."""

    _what = "ring attention"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n, h, d = q.shape
        uly = self.sp.ulysses

        def to_heads(t: torch.Tensor) -> torch.Tensor:  # (B, n, H, D) -> (B, H/U, U*n, D), as Ulysses does
            return t.transpose(1, 2) if uly is None else uly.heads(t, _TORCH)

        assert self.sp.ring is not None
        out = ring_attention(self.sp.ring, to_heads(q), to_heads(k), to_heads(v)).to(q.dtype)
        if uly is None:
            return out.transpose(1, 2).reshape(b, n, h * d)
        return uly.tokens(out, _TORCH)
