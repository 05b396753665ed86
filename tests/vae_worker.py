"""One rank of the parallel VAE check over any number of ranks (started by tests/test_vae.py).

`python tests/vae_worker.py WAN22_DIR [FLUX_DIR]`: the folders' VAEs (Wan's, Flux's AutoencoderKL),
their tiles spread over every rank of the world (hsdp.pipelines.vae.TileSpread), against the
stock tiled decode and encode in this process: bit for bit (decode: on the writer; encode: on
every rank). 3 ranks make the tiles uneven (20 = 7 + 7 + 6; 12 = 4 x 3).
"""

from __future__ import annotations

import sys

import torch

import hsdp
from hsdp.pipelines.vae import TileSpread

torch.set_num_threads(1)


def check(kind: str, path: str, world: object) -> None:
    from diffusers import AutoencoderKL, AutoencoderKLWan

    g = torch.Generator().manual_seed
    if kind == "wan":
        cls, tiles = AutoencoderKLWan, dict(tile_sample_min_height=32, tile_sample_min_width=32,
                                            tile_sample_stride_height=16, tile_sample_stride_width=16)
        z, x = torch.randn(1, 16, 3, 8, 10, generator=g(0)), torch.rand(1, 3, 5, 64, 80, generator=g(1)) * 2 - 1
    else:
        cls, tiles = AutoencoderKL, {}
        z, x = torch.randn(1, 4, 40, 36, generator=g(0)), torch.rand(1, 3, 80, 72, generator=g(1)) * 2 - 1
    vae, ref = cls.from_pretrained(f"{path}/vae").eval(), cls.from_pretrained(f"{path}/vae").eval()
    for v in (vae, ref):
        v.enable_tiling(**tiles)
    spread = TileSpread(vae, world, world.size)  # type: ignore[attr-defined]
    with torch.inference_mode():
        got = vae.decode(z).sample
        enc = vae.encode(x).latent_dist.mode()
        assert torch.equal(enc, ref.encode(x).latent_dist.mode()), kind
        assert spread.last["tiles"] > world.size and spread.last_encode["tiles"] > world.size, spread.last  # type: ignore[attr-defined]
        if world.rank == 0:  # type: ignore[attr-defined]
            assert torch.equal(got, ref.decode(z).sample), kind
    print(f"rank {world.rank}: {kind} vae ok ({spread.spread()})", flush=True)  # type: ignore[attr-defined]


def main() -> None:
    world = hsdp.distributed.init_process_group()
    check("wan", sys.argv[1], world)
    if len(sys.argv) > 2:
        check("flux", sys.argv[2], world)


if __name__ == "__main__":
    main()
