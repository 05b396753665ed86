"""The parallel VAE's refusals and fallbacks in one process (its multi-rank runs against the
stock pipeline are in tests/test_pipelines.py and tests/test_dp.py)."""

from __future__ import annotations

import logging
import re

import pytest

torch = pytest.importorskip("torch")  # torch is an optional dependency; make test installs it

from hsdp.engine.config import DiffusionParallelConfig  # noqa: E402
from hsdp.pipelines.vae import TileSpread  # noqa: E402


class _Group:
    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank


def test_sizes_the_world_cannot_hold_are_refused_naming_the_limit():
    with pytest.raises(ValueError, match=r"vae_patch_parallel_size=3 .* only the world of 2 ranks; use at most 2"):
        DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2, vae_patch_parallel_size=3)
    with pytest.raises(ValueError, match=r"only the 2 ranks of a data parallel lane \(world 4 / "
                                         r"data_parallel_size=2\); use at most 2"):
        DiffusionParallelConfig(use_hsdp=True, data_parallel_size=2, ulysses_degree=2, vae_patch_parallel_size=4)
    with pytest.raises(ValueError, match="vae_patch_parallel_size must be a positive int, got 0"):
        DiffusionParallelConfig(vae_patch_parallel_size=0)
    config = DiffusionParallelConfig(use_hsdp=True, ulysses_degree=2, vae_patch_parallel_size=2)
    assert config.world_size == 2 and "the VAE's tiles over 2 ranks" in config.describe()  # it adds no ranks
    assert DiffusionParallelConfig.from_dict(config.to_dict()) == config


def test_a_vae_without_tiled_decode_decodes_whole_with_a_warning(caplog):
    class Plain(torch.nn.Module):
        def decode(self, z):
            return z

    with caplog.at_level(logging.WARNING, logger="hsdp"):
        spread = TileSpread(Plain(), _Group(2, 0), 2)
    assert not spread.tiled and "has no tiled decode" in caplog.text and "decodes whole on one rank" in caplog.text


def test_tiling_is_switched_on_and_a_lone_rank_decodes_as_stock():
    from diffusers import AutoencoderKL

    def vae():
        torch.manual_seed(0)
        return AutoencoderKL(block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                             down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             sample_size=16).eval()

    ours, ref = vae(), vae()
    assert not ours.use_tiling
    spread = TileSpread(ours, _Group(2, 1), 1)  # a group of 2, the VAE over 1 rank: the stock decode
    assert ours.use_tiling and spread.tiled
    ref.enable_tiling()
    z = torch.randn(1, 4, 20, 20, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(ours.decode(z).sample, ref.decode(z).sample)
    # the census counts the stock loop's tiles without decoding: AutoencoderKL's defaults here
    # (8 x 8 latent tiles every 6) give 4 x 4 tiles of a 20 x 20 latent, the last row and column
    # 2 wide; a cost is the elements the decoder takes (4 channels)
    two = TileSpread(vae(), _Group(2, 0), 2)
    full, edge, corner = 4 * 8 * 8, 4 * 8 * 2, 4 * 2 * 2
    assert two._census(z, (), {}) == [full, full, full, edge] * 3 + [edge, edge, edge, corner]


def test_tiles_are_dealt_so_the_writer_finishes_first_and_received_as_they_finish():
    from hsdp.pipelines.vae import _finishes, deal, receive_order

    # 2 rows x 3 columns, the last row and column smaller (bench_vae's tiles): round robin is
    # the best here (every owner list of 2 ranks tried: none ends the writer's loop sooner)
    costs = [400, 400, 320, 320, 320, 256]
    assert deal(costs, 2) == [0, 1, 0, 1, 0, 1] and _finishes(costs, deal(costs, 2), 2)[0] == 1040
    # 4 rows x 4 columns: round robin puts whole columns on one rank (the writer's loop ends at
    # 0.526 of the area); moves and swaps end it at 0.512
    costs = [400, 400, 400, 320] * 3 + [320, 320, 320, 256]
    robin = _finishes(costs, [t % 2 for t in range(16)], 2)[0]
    dealt = deal(costs, 2)
    assert robin == 3040 and _finishes(costs, dealt, 2)[0] == 2960, (robin, dealt)  # of 5776
    # the simulated decode: the writer waits for tile 1 until rank 1 has done it
    assert _finishes([1, 5, 1], [0, 1, 0], 2) == (5 + 1, [1, 5, 2])
    # received in the order the other ranks finish: rank 2's first tile before rank 1's second
    assert receive_order([1, 1, 1, 1, 1, 1], [0, 1, 2, 0, 1, 2]) == [1, 2, 4, 5]
    assert receive_order([1, 4, 1, 1, 1], [0, 1, 2, 2, 2]) == [2, 3, 4, 1]
    owners = deal([1] * 20, 3)
    assert [owners.count(r) for r in range(3)] == [7, 7, 6]
    assert deal([], 2) == [] and deal([5, 5], 1) == [0, 0]


def test_three_ranks_uneven_tiles_decode_and_encode_bit_for_bit(tmp_path):
    from mpirun import run_ranks

    from hsdp.testing.tiny_pipeline import make_tiny_pipeline

    wan = make_tiny_pipeline(tmp_path / "wan22", "wan22")  # Flux's VAE over 2 ranks: tests/test_pipelines.py
    out = run_ranks(3, "tests/vae_worker.py", str(wan)).stdout
    assert out.count("wan vae ok") == 3, out
    assert re.search(r"20 tiles over 3 ranks: 7 \+ 7 \+ 6 \(area 0\.\d+ \+ 0\.\d+ \+ 0\.\d+\)", out), out
