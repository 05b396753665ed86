"""A tiny random diffusers pipeline folder, written with ``save_pretrained`` (no hub access).

    python -m hsdp.testing.tiny_pipeline DIR --kind wan|wan22|wan22-i2v|flux [--seed N]

``DiffusionPipeline.from_pretrained(DIR)`` gives the stock pipeline class (WanPipeline,
WanImageToVideoPipeline or FluxPipeline), and it generates in well under a second on one
core at the sizes the tests use (Wan: 5 frames of 32x32; Flux: 32x32). Every part is what
the real pipelines ship, at toy sizes:

- tokenizers: a word-level ``tokenizers.Tokenizer`` wrapped in ``PreTrainedTokenizerFast``,
  with the special tokens the real ones append (T5's ``</s>``, CLIP's start and end);
- text encoders: ``UMT5EncoderModel`` (Wan), ``CLIPTextModel`` + ``T5EncoderModel`` (Flux);
- transformers: ``WanTransformer3DModel`` (``wan22``: two experts ``transformer`` and
  ``transformer_2`` with ``boundary_ratio=0.875``; ``wan22-i2v``: in_channels 36 and no
  image encoder, as Wan 2.2 image-to-video) or ``FluxTransformer2DModel``;
- VAE ``AutoencoderKLWan`` / ``AutoencoderKL``; scheduler ``UniPCMultistepScheduler``
  (flow prediction, as Wan ships) / ``FlowMatchEulerDiscreteScheduler`` (Flux).

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

KINDS = ("wan", "wan22", "wan22-i2v", "flux")

# Words the tokenizers know; anything else is the unknown token.
_WORDS = (
    "a an the of in on at with and or to from by for is are under over near cat dog bird fish horse "
    "car tree sky sea river mountain city street house forest field snow rain sun moon night day light "
    "red green blue yellow white black small big slow fast running flying swimming walking sitting "
    "video photo painting cinematic beautiful blurry low quality bad worst ugly static"
).split()

MAX_SHARD_SIZE = "40KB"  # small enough that every transformer and text encoder spans 2+ files


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


def _wan_transformer(in_channels: int, d_text: int, layers: int) -> Any:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=in_channels,
        out_channels=16, text_dim=d_text, freq_dim=32, ffn_dim=64, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    ).eval()


def _wan(kind: str) -> tuple[type, dict[str, Any]]:
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
        transformer=_wan_transformer(36 if i2v else 16, d_text, 3),
    )
    if kind == "wan":
        return WanPipeline, parts
    parts.update(transformer_2=_wan_transformer(36 if i2v else 16, d_text, 2), boundary_ratio=0.875)
    if i2v:  # Wan 2.2 image-to-video: the image enters as latents only, no CLIP image encoder
        return WanImageToVideoPipeline, dict(parts, image_encoder=None, image_processor=None)
    return WanPipeline, parts


def _flux() -> tuple[type, dict[str, Any]]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    d = 32
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=d, pooled_projection_dim=d, axes_dims_rope=(4, 6, 6),
        guidance_embeds=True,
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


def build_tiny_pipeline(kind: str, seed: int = 0) -> Any:
    """The tiny pipeline object itself (random weights from `seed`), not saved."""
    import torch

    if kind not in KINDS:
        raise ValueError(f"tiny pipeline kind {kind!r} is not one of {', '.join(KINDS)}")
    torch.manual_seed(seed)
    cls, parts = _flux() if kind == "flux" else _wan(kind)
    return cls(**parts)


def make_tiny_pipeline(dir: str | os.PathLike[str], kind: str, seed: int = 0) -> Path:
    """Write a tiny random ``kind`` pipeline (see the module docstring) into `dir` with
    ``save_pretrained``; returns the folder. It is written beside `dir` and renamed into
    place, so an interrupted write never looks complete; an existing `dir` is replaced."""
    pipe = build_tiny_pipeline(kind, seed)
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
    args = p.parse_args(argv)
    folder = make_tiny_pipeline(args.dir, args.kind, args.seed)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
