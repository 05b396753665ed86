"""A tiny random diffusers pipeline folder, written with ``save_pretrained`` (no hub access).

    python -m hsdp.testing.tiny_pipeline DIR --kind wan|wan22|wan22-i2v|flux|ltx [--seed N]
                                         [--heads H] [--layers L] [--dim D]

``DiffusionPipeline.from_pretrained(DIR)`` gives the stock pipeline class (WanPipeline,
WanImageToVideoPipeline, FluxPipeline or LTXPipeline), and it generates in well under a
second on one core at the sizes the tests use. Every part is what the real pipelines ship,
at toy sizes:

- tokenizers: a word-level ``tokenizers.Tokenizer`` wrapped in ``PreTrainedTokenizerFast``,
  with the special tokens the real ones append (T5's ``</s>``, CLIP's start and end);
- text encoders: ``UMT5EncoderModel`` (Wan), ``CLIPTextModel`` + ``T5EncoderModel`` (Flux),
  ``T5EncoderModel`` (LTX);
- transformers: ``WanTransformer3DModel`` (``wan22``: two experts ``transformer`` and
  ``transformer_2`` with ``boundary_ratio=0.875``; ``wan22-i2v``: in_channels 36 and no
  image encoder, as Wan 2.2 image-to-video), ``FluxTransformer2DModel`` or
  ``LTXVideoTransformer3DModel`` (which has a ``_cp_plan``);
- VAE ``AutoencoderKLWan`` / ``AutoencoderKL`` / ``AutoencoderKLLTXVideo``; scheduler
  ``UniPCMultistepScheduler`` (flow prediction, as Wan ships) / ``FlowMatchEulerDiscreteScheduler``
  (Flux; LTX with LTX-Video's dynamic shifting settings).

Sizes that work (the pipelines' own checks and the tiny VAEs' compression):

- ``wan``, ``wan22``, ``wan22-i2v``: the pipelines want height and width multiples of 16, so
  16x16 is the smallest (VAE 8x spatial, transformer patch 2x2); the VAE is 4x temporal, so
  ``num_frames`` = 4k+1. The tests use 5 frames of 32x32 and ``max_sequence_length=16`` (the
  default 512 text tokens take seconds);
- ``flux``: height and width multiples of 4 (VAE 2x, 2x2 packing), so 4x4 is the smallest;
  the tests use 32x32;
- ``ltx``: the pipeline wants height and width multiples of 32, so 32x32 is the smallest;
  the VAE is 4x spatial and 4x temporal (the real one: 32x and 8x), so ``num_frames`` = 4k+1
  (1, 5, 9, ...; others give the 4k+1 below); 32x32 with 9 frames is 8x8x3 = 192 tokens. The
  pipeline's defaults (``guidance_scale=3``, so CFG; ``max_sequence_length=128``) all work, and
  2 steps of 9 frames of 32x32 take a fraction of a second.

The transformers' proportions are options (``heads``, ``layers``, ``dim``, or ``--heads``,
``--layers``, ``--dim``; ``None`` keeps the defaults below, bit for bit): ``heads`` is the number
of attention heads, ``dim`` the head dim (``attention_head_dim``), ``layers`` the number of
blocks. Defaults: 2 heads of 16 everywhere; layers 3 for Wan (``wan22``'s ``transformer_2``: 2),
2 for Flux (2 double-stream and 2 single-stream blocks) and LTX. With ``layers=L``: Wan's
``transformer`` gets L and ``wan22``'s ``transformer_2`` gets max(1, L-1), so the two experts keep
different depths (as the default 3 and 2: an expert loaded in the other's place fails on shapes;
the real Wan 2.2 A14B experts are both 40); Flux gets L double-stream and L single-stream blocks.
Constraints (a ``ValueError`` names the parameter): each is a positive int; Flux's ``dim`` must be
even and at least 6 (its ``axes_dims_rope``, three even sizes of at least 2 summing to the head dim,
are derived from it: 16 -> (4, 6, 6), 128 -> (16, 56, 56) as the real Flux); Wan's ``dim`` must be
even (its rotary embedding turns pairs of channels in each head); LTX's ``heads * dim`` must be
even and at least 6 (its rotary embedding turns pairs of channels over all heads together, a third
of the pairs for each of the 3 axes). The text encoders, the VAEs and Wan's FFN width (64) do
not change with these options; Flux's and LTX's FFNs are 4x the model width, as ever.

Models are saved with a small ``max_shard_size``, so each transformer and text encoder is
split over 2+ safetensors files with an index (the loader's index path).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

KINDS = ("wan", "wan22", "wan22-i2v", "flux", "ltx")

# Words the tokenizers know; anything else is the unknown token.
_WORDS = (
    "a an the of in on at with and or to from by for is are under over near cat dog bird fish horse "
    "car tree sky sea river mountain city street house forest field snow rain sun moon night day light "
    "red green blue yellow white black small big slow fast running flying swimming walking sitting "
    "video photo painting cinematic beautiful blurry low quality bad worst ugly static"
).split()

MAX_SHARD_SIZE = "40KB"  # small enough that every transformer and text encoder spans 2+ files

# Each kind's transformer when heads, layers or dim is None (the folders tests and records depend on).
DEFAULT_HEADS = 2
DEFAULT_DIM = 16
DEFAULT_LAYERS = {"wan": 3, "wan22": 3, "wan22-i2v": 3, "flux": 2, "ltx": 2}


def _positive(name: str, value: int | None, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"tiny pipeline {name} must be a positive int, not {value!r}")  # noqa: TRY004
    if value < 1:
        raise ValueError(f"tiny pipeline {name} must be a positive int, not {value}")
    return value


def flux_axes_dims_rope(dim: int) -> tuple[int, int, int]:
    """Flux's ``axes_dims_rope`` for head dim `dim`: three even sizes of at least 2 that sum to
    `dim`, the first the smallest such size of at least dim/8 and the other two equal (16 ->
    (4, 6, 6), 128 -> (16, 56, 56) as the real Flux). `dim` must be even and at least 6."""
    if dim % 2 or dim < 6:
        raise ValueError(f"tiny flux dim={dim}: Flux's axes_dims_rope are three even sizes of at least 2 "
                         "summing to the head dim, so dim must be even and at least 6")
    first = max(2, -(-dim // 8))
    first += first % 2
    if (dim - first) % 4:
        first += 2
    return first, (dim - first) // 2, (dim - first) // 2


def _check_dims(kind: str, heads: int, dim: int) -> None:
    if kind == "flux":
        flux_axes_dims_rope(dim)
    elif kind == "ltx":
        if heads * dim % 2 or heads * dim < 6:
            raise ValueError(f"tiny ltx heads={heads}, dim={dim}: LTX's rotary embedding turns pairs of channels "
                             "over all heads together, a third of the pairs for each of the 3 axes, so heads * dim "
                             f"must be even and at least 6, not {heads * dim}")
    elif dim % 2:
        raise ValueError(f"tiny {kind} dim={dim}: Wan's rotary embedding turns pairs of channels in each head, "
                         "so dim must be even")


def _tokenizer(specials: list[str], template: str, unk: str, pad: str, eos: str, max_len: int,
               bos: str | None = None) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials)}
    for w in _WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    used = [t for t in specials if t in template]
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[(t, vocab[t]) for t in used])
    kwargs: dict[str, Any] = dict(tokenizer_object=tok, pad_token=pad, eos_token=eos, unk_token=unk,
                                  model_max_length=max_len)
    if bos is not None:
        kwargs["bos_token"] = bos
    return PreTrainedTokenizerFast(**kwargs)


def _t5_tokenizer(max_len: int = 512) -> Any:
    # T5's ids: pad 0, eos 1, unk 2; the eos ends every sequence
    return _tokenizer(["<pad>", "</s>", "<unk>"], "$A </s>", unk="<unk>", pad="<pad>", eos="</s>", max_len=max_len)


def _clip_tokenizer() -> Any:
    specials = ["<|endoftext|>", "<|startoftext|>", "<unk>"]  # eos (also pad) 0, bos 1, unk 2
    return _tokenizer(specials, "<|startoftext|> $A <|endoftext|>", unk="<unk>", pad="<|endoftext|>",
                      eos="<|endoftext|>", max_len=77, bos="<|startoftext|>")


def _vocab_size() -> int:
    return 3 + len(dict.fromkeys(_WORDS))


def _umt5(d: int) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = UMT5Config(vocab_size=_vocab_size(), d_model=d, d_kv=8, d_ff=2 * d, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=32,
                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return UMT5EncoderModel(cfg).eval()


def _t5(d: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=_vocab_size(), d_model=d, d_kv=8, d_ff=2 * d, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=32,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(cfg).eval()


def _clip(d: int) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(vocab_size=_vocab_size(), hidden_size=d, intermediate_size=2 * d, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, projection_dim=d, hidden_act="gelu",
                         bos_token_id=1, eos_token_id=0, pad_token_id=0)
    return CLIPTextModel(cfg).eval()


def _wan_transformer(in_channels: int, d_text: int, layers: int, heads: int, dim: int) -> Any:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=dim, in_channels=in_channels,
        out_channels=16, text_dim=d_text, freq_dim=32, ffn_dim=64, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    ).eval()


def _wan(kind: str, heads: int, layers: int, dim: int) -> tuple[type, dict[str, Any]]:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline

    d_text = 32
    i2v = kind == "wan22-i2v"
    parts: dict[str, Any] = dict(
        tokenizer=_t5_tokenizer(),
        text_encoder=_umt5(d_text),
        # z_dim 16: the pipelines' latents_mean/std have 16 entries; 3 downsamples: 8x spatial, 4x temporal
        vae=AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                             temperal_downsample=[False, True, True]).eval(),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                          num_train_timesteps=1000, flow_shift=3.0),
        transformer=_wan_transformer(36 if i2v else 16, d_text, layers, heads, dim),
    )
    if kind == "wan":
        return WanPipeline, parts
    parts.update(transformer_2=_wan_transformer(36 if i2v else 16, d_text, max(1, layers - 1), heads, dim),
                 boundary_ratio=0.875)
    if i2v:  # Wan 2.2 image-to-video: the image enters as latents only, no CLIP image encoder
        return WanImageToVideoPipeline, dict(parts, image_encoder=None, image_processor=None)
    return WanPipeline, parts


def _flux(heads: int, layers: int, dim: int) -> tuple[type, dict[str, Any]]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    d = 32
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=layers, num_single_layers=layers, attention_head_dim=dim,
        num_attention_heads=heads, joint_attention_dim=d, pooled_projection_dim=d,
        axes_dims_rope=flux_axes_dims_rope(dim), guidance_embeds=True,
    ).eval()
    # 2 levels: 2x downsampling; 4 latent channels, packed 2x2 into the transformer's 16
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1, latent_channels=4,
        norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035, sample_size=32,
    ).eval()
    return FluxPipeline, dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                  max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096),
        text_encoder=_clip(d), tokenizer=_clip_tokenizer(),
        text_encoder_2=_t5(d), tokenizer_2=_t5_tokenizer(),
        transformer=transformer, vae=vae,
    )


def _ltx(heads: int, layers: int, dim: int) -> tuple[type, dict[str, Any]]:
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    d_text, latent = 32, 16
    # the blocks attend to the caption projected to heads * dim, so cross_attention_dim is that too
    transformer = LTXVideoTransformer3DModel(
        in_channels=latent, out_channels=latent, patch_size=1, patch_size_t=1, num_attention_heads=heads,
        attention_head_dim=dim, cross_attention_dim=heads * dim, num_layers=layers, caption_channels=d_text,
    ).eval()
    # 2 blocks, each halving space and time: 4x spatial and 4x temporal (the real VAE: patch 4 and
    # 3 blocks, 32x and 8x); no timestep conditioning (as LTX-Video 0.9.0)
    blocks = 2
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=latent, block_out_channels=(4,) * blocks,
        down_block_types=("LTXVideoDownBlock3D",) * blocks, decoder_block_out_channels=(4,) * blocks,
        layers_per_block=(1,) * (blocks + 1), decoder_layers_per_block=(1,) * (blocks + 1),
        spatio_temporal_scaling=(True,) * blocks, decoder_spatio_temporal_scaling=(True,) * blocks,
        decoder_inject_noise=(False,) * (blocks + 1), downsample_type=("conv",) * blocks,
        upsample_residual=(False,) * blocks, upsample_factor=(1,) * blocks, timestep_conditioning=False,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    ).eval()
    # LTX-Video's scheduler settings (shift from the token count)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
        base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1,
    )
    return LTXPipeline, {"scheduler": scheduler, "vae": vae, "text_encoder": _t5(d_text), "tokenizer": _t5_tokenizer(),
                         "transformer": transformer}


def build_tiny_pipeline(kind: str, seed: int = 0, *, heads: int | None = None, layers: int | None = None,
                        dim: int | None = None) -> Any:
    """The tiny pipeline object itself (random weights from `seed`), not saved. `heads`,
    `layers` and `dim` (head dim) size the transformer(s); None keeps the defaults (see the
    module docstring for what each kind does with them and the constraints)."""
    if kind not in KINDS:
        raise ValueError(f"tiny pipeline kind {kind!r} is not one of {', '.join(KINDS)}")
    h = _positive("heads", heads, DEFAULT_HEADS)
    n = _positive("layers", layers, DEFAULT_LAYERS[kind])
    d = _positive("dim", dim, DEFAULT_DIM)
    _check_dims(kind, h, d)
    import torch

    torch.manual_seed(seed)
    if kind == "flux":
        cls, parts = _flux(h, n, d)
    elif kind == "ltx":
        cls, parts = _ltx(h, n, d)
    else:
        cls, parts = _wan(kind, h, n, d)
    return cls(**parts)


def make_tiny_pipeline(dir: str | os.PathLike[str], kind: str, seed: int = 0, *, heads: int | None = None,
                       layers: int | None = None, dim: int | None = None) -> Path:
    """Write a tiny random ``kind`` pipeline (see the module docstring) into `dir` with
    ``save_pretrained``; returns the folder. It is written beside `dir` and renamed into
    place, so an interrupted write never looks complete; an existing `dir` is replaced.
    `heads`, `layers`, `dim`: as for `build_tiny_pipeline`."""
    pipe = build_tiny_pipeline(kind, seed, heads=heads, layers=layers, dim=dim)
    folder = Path(dir)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, max_shard_size=MAX_SHARD_SIZE, safe_serialization=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hsdp.testing.tiny_pipeline",
                                description="Write a tiny random diffusers pipeline folder (no downloads).")
    p.add_argument("dir", type=Path, help="the folder to write (replaced if it exists)")
    p.add_argument("--kind", choices=KINDS, default="wan22", help="which pipeline (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    p.add_argument("--heads", type=int, help="the transformer's attention heads (default 2)")
    p.add_argument("--layers", type=int,
                   help="the transformer's blocks (default 3 for Wan, 2 for Flux and LTX; wan22's second expert "
                        "gets one fewer, Flux as many single-stream blocks)")
    p.add_argument("--dim", type=int, help="the attention head dim (default 16)")
    args = p.parse_args(argv)
    try:
        folder = make_tiny_pipeline(args.dir, args.kind, args.seed, heads=args.heads, layers=args.layers,
                                    dim=args.dim)
    except ValueError as e:
        p.error(str(e))
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
