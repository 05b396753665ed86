"""A user's test of their own model, as docs/testing.md shows it, run by the pytest plugin
(@pytest.mark.hsdp): a tiny Wan 2.2 pipeline sharded over 2 ranks (HSDP 1x2) gives the stock
unsharded pipeline's float32 frames. The fixture runs on each rank (not in the pytest
process that starts the job)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def my_model(tmp_path_factory: pytest.TempPathFactory):
    from hsdp.testing.tiny_pipeline import make_tiny_pipeline

    return make_tiny_pipeline(tmp_path_factory.mktemp("model") / "wan22", "wan22", seed=0)


@pytest.mark.hsdp(ranks=2, timeout=300)
def test_my_model_sharded_equals_the_stock_pipeline(my_model, hsdp_world):
    import hsdp.pipelines as hp
    from diffusers import DiffusionPipeline
    from hsdp import DiffusionParallelConfig

    pipe = hp.load_pipeline(my_model, DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2),
                            dtype=torch.float32, progress=False)
    call = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2,
                "max_sequence_length": 16, "output_type": "np"}
    out = hp.generate(pipe, **call, generator=torch.Generator().manual_seed(0))
    assert hp.pipeline_state(pipe).sharded == ["text_encoder", "transformer", "transformer_2"]
    if hsdp_world.rank == 0:  # rank 0 holds the output
        stock = DiffusionPipeline.from_pretrained(my_model, torch_dtype=torch.float32)
        stock.set_progress_bar_config(disable=True)
        want = stock(**call, generator=torch.Generator().manual_seed(0)).frames
        assert np.abs(out.frames - want).max() <= 1e-4
    else:
        assert out is None
