"""Ulysses sequence parallel for diffusers' Wan transformers (torch; CPU ranks over MPI, or GPUs over NCCL).

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

import torch
import torch.nn.functional as F

from ..adapters.torch import TorchAdapter
from .groups import ParallelGroups
from .ulysses import Ulysses
from .cfg import cfg_combine as _cfg_combine

_TORCH = TorchAdapter()  # the exchanges are hsdp.parallel's, run on torch tensors through it


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # diffusers' Wan rotary embedding, on interleaved pairs
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


def local_qkv(attn: Any, hidden_states: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
              sp: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's tokens' q, k, v, (B, n, H, D), as diffusers' WanAttnProcessor makes them
    (projections, q/k norms, rotary embedding): all of it per token, so local tokens suffice."""
    if attn.fused_projections:
        q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    q, k = attn.norm_q(q), attn.norm_k(k)  # across heads, per token
    heads = attn.heads
    sp.check_heads(heads)
    q, k, v = (t.unflatten(2, (heads, -1)) for t in (q, k, v))
    if rotary_emb is not None:
        q, k = _rotary(q, *rotary_emb), _rotary(k, *rotary_emb)
    return q, k, v


class WanSelfAttnProcessor:
    """A drop-in for diffusers' WanAttnProcessor whose self-attention runs over the whole
    sequence, the tokens split across ``sp``'s ranks; cross-attention keeps the stock
    processor ``inner`` (its keys are the text, whole). Subclasses say how (:meth:`attend`)."""

    _what = "sequence parallel self-attention"

    def __init__(self, sp: Any, inner: Any) -> None:
        self.sp = sp
        self.inner = inner

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if encoder_hidden_states is not None:
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if attention_mask is not None:
            raise NotImplementedError(f"{self._what} with an attention mask is not built")
        q, k, v = local_qkv(attn, hidden_states, rotary_emb, self.sp)
        hidden = attn.to_out[0](self.attend(q, k, v).type_as(q))
        return attn.to_out[1](hidden)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's tokens' (B, n, H, D) q, k, v -> its tokens' attention output (B, n, H * D)."""
        raise NotImplementedError


class UlyssesWanAttnProcessor(WanSelfAttnProcessor):
    """Self-attention over the whole sequence for 1/U of the heads, between two all-to-alls."""

    _what = "Ulysses self-attention"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sp, ad = self.sp, _TORCH
        out = F.scaled_dot_product_attention(sp.heads(q, ad), sp.heads(k, ad), sp.heads(v, ad),
                                             dropout_p=0.0, is_causal=False)
        return sp.tokens(out, ad)


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
        from .ring_wan import USPWanAttnProcessor as processor
    for block in model.blocks:
        block.register_forward_pre_hook(split)
        block.attn1.set_processor(processor(sp, block.attn1.processor))
    model.proj_out.register_forward_hook(lambda module, args, out: sp.gather_tokens(out, _TORCH))
    return model


def cfg_combine(groups: ParallelGroups, branch: Callable[[int], torch.Tensor], guidance_scale: float) -> torch.Tensor:
    """:func:`hsdp.parallel.cfg_combine` on torch tensors (on the GPU through NCCL):
    uncond + scale * (cond - uncond) in float32, the same on every rank."""
    return _cfg_combine(groups, branch, guidance_scale, _TORCH)
