"""Ulysses sequence parallel for diffusers' Wan transformers (torch, CPU ranks over MPI).

``apply_sequence_parallel_torch(model, sp)`` makes a stock ``WanTransformer3DModel`` run with
its tokens split over an :class:`hsdp.parallel.Ulysses` group, with or without hsdp sharding
its weights:

- a pre-hook on every block hands it this rank's tokens (the first block splits them), and
  the matching slice of the rotary tables;
- :class:`UlyssesWanAttnProcessor`, a drop-in for diffusers' ``WanAttnProcessor``, runs each
  self-attention (``attn1``) over the whole sequence for 1/U of the heads, between two
  all-to-alls; cross-attention keeps the stock processor (its keys are the text, whole);
- a hook on ``proj_out`` all-gathers the tokens, so the model's output is whole on every rank.

Per-token timesteps (Wan 2.2 TI2V's ``timestep`` of shape (B, N)) and image conditioning
(``add_k_proj``) are refused with ``NotImplementedError``. Imported only by callers, so
``import hsdp`` never pulls torch in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import devices
from .adapters.torch import _RAW_AS
from .parallel import ParallelGroups, Ulysses


def _np(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a NumPy array, zero-copy (bfloat16 and float8 as
    integers of their size, as the torch adapter hands them to the C unit)."""
    raw = _RAW_AS.get(t.dtype)
    return (t.view(raw) if raw is not None else t).numpy()


def _stream(t: torch.Tensor) -> int | None:
    """torch's current stream on t's device: a device collective runs after the work that
    made its input there, and before the work that reads its output (None: a device viewed
    as the CPU has no streams)."""
    return int(torch.cuda.current_stream(t.device).cuda_stream) if t.is_cuda else None


def _on_device(group: Any, t: torch.Tensor) -> bool:
    """Whether t lives on the group's device (its backend's device table says which
    framework device type that is): then the collective runs on the tensor itself."""
    info = devices.of_group(group)
    return info.on_device and t.device.type == info.framework


def _all_to_all(sp: Ulysses, send: torch.Tensor) -> torch.Tensor:
    send = send.contiguous()
    recv = torch.empty_like(send)
    if _on_device(sp.group, send):  # NCCL: on the tensors themselves, ordered on torch's current stream
        sp.group.all_to_all_device(send.data_ptr(), recv.data_ptr(), send.numel() * send.element_size() // sp.degree,
                                   _stream(send))
    else:
        sp.group.all_to_all(_np(send), _np(recv))
    return recv


def _all_gather_tokens(sp: Ulysses, x: torch.Tensor) -> torch.Tensor:
    """Every rank's (B, n, C) -> (B, U * n, C) in rank order."""
    x = x.contiguous()
    recv = torch.empty((sp.degree, *x.shape), dtype=x.dtype, device=x.device)
    if _on_device(sp.group, x):
        sp.group.all_gather_device(x.data_ptr(), recv.data_ptr(), x.numel() * x.element_size(), _stream(x))
    else:
        sp.group.all_gather(_np(x), _np(recv))
    return recv.transpose(0, 1).reshape(x.shape[0], sp.degree * x.shape[1], *x.shape[2:])


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # diffusers' Wan rotary embedding, on interleaved pairs
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class UlyssesWanAttnProcessor:
    """Self-attention over the whole sequence, the tokens split across ``sp``'s ranks."""

    def __init__(self, sp: Ulysses, inner: Any) -> None:
        self.sp = sp
        self.inner = inner  # the stock processor, for cross-attention

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if encoder_hidden_states is not None:
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if attention_mask is not None:
            raise NotImplementedError("Ulysses self-attention with an attention mask is not built")
        sp, p = self.sp, self.sp.degree
        if attn.fused_projections:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)  # across heads, per token: local tokens suffice
        heads = attn.heads
        sp.check_heads(heads)
        q, k, v = (t.unflatten(2, (heads, -1)) for t in (q, k, v))  # (B, n, H, D)
        if rotary_emb is not None:
            q, k = _rotary(q, *rotary_emb), _rotary(k, *rotary_emb)
        b, n, h, d = q.shape

        def to_heads(t: torch.Tensor) -> torch.Tensor:
            # block j of the send: head group j for my tokens; block i of the recv: rank i's
            # tokens for my heads -> (B, H/U, N, D)
            recv = _all_to_all(sp, t.reshape(b, n, p, h // p, d).permute(2, 0, 1, 3, 4))
            return recv.permute(1, 3, 0, 2, 4).reshape(b, h // p, p * n, d)

        out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), dropout_p=0.0, is_causal=False)
        # back: block j of the send is rank j's tokens for my heads; block i of the recv is
        # head group i for my tokens -> (B, n, H, D)
        recv = _all_to_all(sp, out.reshape(b, h // p, p, n, d).permute(2, 0, 3, 1, 4))
        hidden = recv.permute(1, 2, 0, 3, 4).reshape(b, n, h * d).type_as(q)
        hidden = attn.to_out[0](hidden)
        return attn.to_out[1](hidden)


def apply_sequence_parallel_torch(model: Any, sp: Any) -> Any:
    """Run a diffusers ``WanTransformer3DModel`` with its tokens split over `sp`, a
    :class:`~hsdp.parallel.Ulysses` or a :class:`hsdp.ring.USP` (ring attention, alone or
    inside Ulysses: :class:`hsdp.ring_torch.USPWanAttnProcessor`) (see the module docstring). In place; returns the model. Works on a model hsdp has sharded."""
    from diffusers import WanTransformer3DModel

    if not isinstance(model, WanTransformer3DModel):
        raise TypeError(
            f"apply_sequence_parallel_torch takes a diffusers WanTransformer3DModel, got {type(model).__name__}"
        )
    sp.check_heads(model.config.num_attention_heads)
    if any(getattr(b.attn2, "add_k_proj", None) is not None for b in model.blocks):
        raise NotImplementedError("Ulysses for Wan image conditioning (add_k_proj) is not built")

    def split(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, context, temb, rotary = args
        total = rotary[0].shape[1]  # the whole sequence: the rotary tables cover it
        n = sp.local_tokens(total)
        lo, hi = sp.rank * n, (sp.rank + 1) * n
        if temb.ndim == 4:
            raise NotImplementedError("Ulysses with per-token timesteps (Wan 2.2 TI2V) is not built")
        if hidden.shape[1] == total:  # the first block: this rank's tokens from here on
            hidden = hidden[:, lo:hi].contiguous()
        return hidden, context, temb, (rotary[0][:, lo:hi], rotary[1][:, lo:hi])

    processor: Any = UlyssesWanAttnProcessor
    if not isinstance(sp, Ulysses):  # a hsdp.ring.USP (ring_degree > 1): Ulysses x ring attention
        from .ring_torch import USPWanAttnProcessor as processor
    for block in model.blocks:
        block.register_forward_pre_hook(split)
        block.attn1.set_processor(processor(sp, block.attn1.processor))
    model.proj_out.register_forward_hook(lambda module, args, out: _all_gather_tokens(sp, out))
    return model


def cfg_combine(groups: ParallelGroups, branch: Callable[[int], torch.Tensor], guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance on torch tensors, as :func:`hsdp.parallel.cfg_combine` does on
    arrays: uncond + scale * (cond - uncond) in float32, the same on every rank. With a CFG
    group each rank computes its own branch (``branch(0)`` conditional, ``branch(1)``
    unconditional) and the two are all-gathered (on the GPU through NCCL); without one this
    rank computes both."""
    if groups.cfg is None:
        cond, uncond = branch(0).float(), branch(1).float()
    else:
        mine = branch(groups.cfg_rank).float().contiguous()
        both = torch.empty((groups.cfg_degree, *mine.shape), dtype=torch.float32, device=mine.device)
        if _on_device(groups.cfg, mine):
            groups.cfg.all_gather_device(mine.data_ptr(), both.data_ptr(), mine.numel() * mine.element_size(),
                                         _stream(mine))
        else:
            groups.cfg.all_gather(mine.numpy(), both.numpy())
        cond, uncond = both[0], both[1]
    return uncond + guidance_scale * (cond - uncond)
