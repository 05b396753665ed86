"""hsdp.pipelines: a diffusers pipeline folder loaded with every transformer and text encoder
sharded rank-locally, run by the stock pipeline call in every parallel mode, against the
stock unsharded pipeline; hsdp.testing.tiny_pipeline; the refusals."""

from __future__ import annotations

import dataclasses

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")  # torch is an optional dependency; make test installs it
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from mpirun import run_ranks  # noqa: E402

import hsdp.pipelines as hp  # noqa: E402
from hsdp import _C  # noqa: E402
from hsdp.engine.config import DiffusionParallelConfig  # noqa: E402
from hsdp.testing.tiny_pipeline import make_tiny_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {kind: make_tiny_pipeline(root / kind, kind, seed=0) for kind in ("wan22", "flux", "ltx", "wan22-i2v")}


def test_two_ranks_every_mode_equals_the_stock_pipeline(folders):
    """1x2, Ulysses 2, CFG 2 on Wan 2.2's two experts, Flux on 1x2, CFG 2, Ulysses 2 and ring 2
    (the last two over 81 image tokens: split unevenly), LTX-Video on Ulysses 2 and ring 2 (its
    text and padding mask split too), the VAE's tiles over 2 ranks (Wan 2.2 with HSDP 1x2 and with
    Ulysses 2, its image-to-video encode and decode, Flux, LTX-Video; against the stock pipeline
    tiled the same way) (fp32 frames equal to the stock pipeline's), a bf16 run, and a bad folder on one
    rank only (every rank raises)."""
    cases = ["bad-folder", "wan22-1x2", "wan22-ulysses2", "wan22-cfg2", "flux-1x2", "flux-cfg2", "bf16",
             "flux-ulysses2-odd", "flux-ring2-odd", "ltx-ulysses2", "ltx-ring2", "wan22-vae2-tiled",
             "wan22-ulysses2-vae2-tiled", "wan22-i2v-vae2-tiled", "flux-vae2-tiled", "ltx-vae2-tiled"]
    out = run_ranks(2, "tests/pipelines_worker.py", str(folders["wan22"]), str(folders["flux"]),
                    f"ltx={folders['ltx']}", f"wan22-i2v={folders['wan22-i2v']}", *cases,
                    timeout=600).stdout
    for case in ("bad folder", *cases[1:]):
        assert out.count(f"{case} ok") == 2, out


def test_four_ranks_replicas_ulysses_with_cfg_and_usp(folders):
    cases = ["wan22-2x2", "wan22-ulysses2-cfg2", "wan22-ulysses2-ring2", "flux-ulysses2-ring2", "flux-ulysses2-cfg2"]
    out = run_ranks(4, "tests/pipelines_worker.py", str(folders["wan22"]), str(folders["flux"]), *cases,
                    timeout=600).stdout
    for case in cases:
        assert out.count(f"{case} ok") == 4, out


def test_tiny_pipeline_loads_with_stock_diffusers_and_generates(folders):
    from diffusers import DiffusionPipeline, WanPipeline

    path = folders["wan22"]
    pipe = DiffusionPipeline.from_pretrained(path)
    assert type(pipe) is WanPipeline and pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.875
    # each model over 2+ files, so a loader takes the index path
    assert len(list((path / "transformer").glob("*.safetensors"))) >= 2
    assert (path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    frames = pipe(prompt="a dog", height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=16,
                  generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert frames.shape == (1, 5, 32, 32, 3)


def test_image_to_video_one_rank_equals_stock(tmp_path):
    """Wan 2.2 I2V (no image encoder, in_channels 36) through load_pipeline on one rank."""
    import numpy as np
    import PIL.Image
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline

    path = make_tiny_pipeline(tmp_path / "i2v", "wan22-i2v", seed=1)
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    call = dict(image=image, prompt="a bird flying", negative_prompt="static", height=32, width=32, num_frames=5,
                num_inference_steps=2, max_sequence_length=16, output_type="np")
    pipe = hp.load_pipeline(path, DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=1), torch_dtype=torch.float32)
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and isinstance(pipe, WanImageToVideoPipeline)
    assert hp.pipeline_state(pipe).sharded == ["text_encoder", "transformer", "transformer_2"]
    got = hp.generate(pipe, **call, generator=torch.Generator().manual_seed(0)).frames
    ref = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)(**call, generator=torch.Generator().manual_seed(0)).frames
    assert np.abs(got - ref).max() <= 1e-4


def _partial_copy(src: Path, dst: Path, keep: tuple[str, ...]) -> Path:
    dst.mkdir()
    shutil.copy(src / "model_index.json", dst / "model_index.json")
    for name in keep:
        shutil.copytree(src / name, dst / name)
    return dst


def test_bad_folders_are_refused_before_any_weight_is_read(folders, tmp_path):
    cfg = DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=1)
    with pytest.raises(ValueError, match="not a diffusers pipeline folder: it has no model_index.json"):
        hp.load_pipeline(folders["wan22"] / "transformer", cfg)
    with pytest.raises(ValueError, match="does not exist"):
        hp.load_pipeline(tmp_path / "nowhere", cfg)
    missing = _partial_copy(folders["wan22"], tmp_path / "missing", ("tokenizer", "scheduler", "vae"))
    with pytest.raises(ValueError, match=r"component 'text_encoder' .* has no folder: .*text_encoder' is missing"):
        hp.load_pipeline(missing, cfg)


def _with_class(src: Path, dst: Path, component: str, library: str, name: str) -> Path:
    dst.mkdir()
    index = json.loads((src / "model_index.json").read_text())
    index[component] = [library, name]
    (dst / "model_index.json").write_text(json.dumps(index))
    for sub in ("tokenizer", "text_encoder", "scheduler", "vae", "transformer", "transformer_2"):
        (dst / sub).mkdir()  # folders only: the classes are refused before any file is opened
    return dst


def test_unknown_and_unregistered_model_classes_are_refused(folders, tmp_path):
    cfg = DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=1)
    unknown = _with_class(folders["wan22"], tmp_path / "unknown", "transformer", "diffusers", "NoSuchTransformer")
    with pytest.raises(ValueError, match="unknown model class diffusers.NoSuchTransformer"):
        hp.load_pipeline(unknown, cfg)
    other = _with_class(folders["wan22"], tmp_path / "other", "transformer_2", "diffusers", "SD3Transformer2DModel")
    with pytest.raises(ValueError, match=r"SD3Transformer2DModel to shard; register its units first: "
                                         r"hsdp.pipelines.register_shard_conditions\('SD3Transformer2DModel'"):
        hp.load_pipeline(other, cfg)
    encoder = _with_class(folders["wan22"], tmp_path / "encoder", "text_encoder", "transformers", "BertModel")
    with pytest.raises(ValueError, match="BertModel to shard.*shard_text_encoders=False"):
        hp.load_pipeline(encoder, cfg)


def test_shard_condition_registry():
    from diffusers import FluxTransformer2DModel

    conds = hp.shard_conditions_for(FluxTransformer2DModel)
    assert [c("transformer_blocks.3", None) for c in conds] == [True, False]
    assert not any(c("transformer_blocks.3.attn", None) or c("blocks.3", None) for c in conds)

    class MyModel(torch.nn.Module):
        pass

    class Child(MyModel):
        pass

    assert hp.shard_conditions_for(Child) is None
    hp.register_shard_conditions(MyModel, ["layers.<i>", lambda n, m: n == "head"])
    conds = hp.shard_conditions_for(Child)  # a base class's entry serves its subclasses
    assert conds[0]("layers.12", None) and not conds[0]("layers.x", None) and conds[1]("head", None)
    with pytest.raises(TypeError, match="module path such as 'blocks.<i>' or a callable"):
        hp.register_shard_conditions("X", [3])


def test_parallel_modes_a_pipeline_cannot_run_are_refused(folders):
    from diffusers import FluxPipeline, SD3Transformer2DModel, StableDiffusion3Pipeline

    from hsdp.pipelines.components import read_components
    from hsdp.pipelines.loader import _check_modes

    flux = read_components(folders["flux"], True, True)
    # any transformer with a context-parallel plan takes Ulysses and ring; heads are checked from config.json
    _check_modes(DiffusionParallelConfig(ulysses_degree=2, ring_degree=2), FluxPipeline, flux)
    with pytest.raises(ValueError, match=r"ulysses_degree=4 splits the attention heads .* component 'transformer' "
                                         r"\(FluxTransformer2DModel, .*transformer/config.json\) has "
                                         r"num_attention_heads=2, not divisible by it"):
        _check_modes(DiffusionParallelConfig(ulysses_degree=4), FluxPipeline, flux)
    _check_modes(DiffusionParallelConfig(ring_degree=4), FluxPipeline, flux)  # ring splits tokens, not heads
    planless = [dataclasses.replace(c, cls=SD3Transformer2DModel, class_name="SD3Transformer2DModel")
                if c.role == "transformer" else c for c in flux]
    with pytest.raises(NotImplementedError, match=r"component 'transformer': sequence parallel \(ulysses_degree=1, "
                                                  r"ring_degree=2\) needs the model's context-parallel plan, and "
                                                  r"SD3Transformer2DModel declares none .*register_plan"):
        _check_modes(DiffusionParallelConfig(ring_degree=2), FluxPipeline, planless)
    _check_modes(DiffusionParallelConfig(cfg_parallel_size=2, use_hsdp=True), FluxPipeline, flux)
    with pytest.raises(NotImplementedError, match="not for StableDiffusion3Pipeline"):
        _check_modes(DiffusionParallelConfig(cfg_parallel_size=2), StableDiffusion3Pipeline, flux)


class _Doubler(torch.nn.Module):
    """A transformer stand-in: counts its forwards, has diffusers' cache_context."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0

    @__import__("contextlib").contextmanager
    def cache_context(self, name):
        yield

    def forward(self, hidden_states, return_dict=True):
        self.forwards += 1
        return (hidden_states * 2,)


class _PeerIsRankZero:
    """CFG group of 2 seen from rank 1: rank 0's row is a float32 'cond' of sevens."""

    size, rank, backend = 2, 1, "mpi"
    device_info = _C.device_info("mpi")  # the real table: hsdp.world.devices caches it per backend

    def all_gather(self, send, recv):
        recv[1] = send
        recv[0, :2] = (0.0, -1.0)  # float32 result, no placeholder
        recv[0, 2:] = 7.0


def _rank1_split(probe):
    from hsdp.parallel import ParallelGroups
    from hsdp.pipelines.cfg import CFGSplit

    groups = ParallelGroups(ulysses_degree=1, cfg_degree=2, ulysses_rank=0, cfg_rank=1, sp=None,
                            cfg=_PeerIsRankZero())
    split = CFGSplit(object(), groups, probe)
    models = _Doubler(), _Doubler()
    for m in models:
        split.install(m)
    return split, models


def test_cfg_split_on_the_uncond_rank():
    """CFG rank 1 skips the cond call (a placeholder), computes uncond at call 2, and fills the
    placeholder in place with rank 0's cond; a pipeline that does not make the promised
    second call is an error, raised before any exchange."""
    split, (model, other) = _rank1_split(lambda pipe, args: True)
    x = torch.ones(1, 3)
    with model.cache_context("cond"):
        cond = model(hidden_states=x, return_dict=False)[0]
    assert cond.numel() == 0 and model.forwards == 0 and type(model).__name__ == "_Doubler"
    with model.cache_context("uncond"):
        uncond = model(hidden_states=x, return_dict=False)[0]
    assert model.forwards == 1 and torch.equal(uncond, x * 2) and torch.equal(cond, torch.full((1, 3), 7.0))
    assert split.steps == 1

    with model.cache_context("cond"):
        model(hidden_states=x, return_dict=False)
    with pytest.raises(RuntimeError, match="said this step calls _Doubler twice .* another model under 'cond'"):
        with other.cache_context("cond"):
            other(hidden_states=x, return_dict=False)

    split, (model, _) = _rank1_split(lambda pipe, args: False)  # no guidance: every rank computes
    assert torch.equal(model(hidden_states=x, return_dict=False)[0], x * 2) and model.forwards == 1
    with pytest.raises(RuntimeError, match="under 'uncond' where its guidance probe said the step has no guidance"):
        with model.cache_context("uncond"):
            model(hidden_states=x, return_dict=False)


def test_batch_lists_that_disagree_are_refused_before_the_call():
    """A prompt list longer than the generator batch, or a negative prompt list of another
    length, is refused by hsdp.pipelines.generate before the pipeline (any model) runs."""
    from hsdp.pipelines import generate

    calls = []

    def pipe(**kwargs):  # stands in for a pipeline: must never be reached by a bad call
        calls.append(kwargs)
        return "frames"

    torch = pytest.importorskip("torch")
    g = [torch.Generator("cpu").manual_seed(i) for i in range(2)]
    with pytest.raises(ValueError, match="generator is a list of 2 generators, but the batch is 3 prompt"):
        generate(pipe, prompt=["a", "b", "c"], generator=g)
    with pytest.raises(ValueError, match="negative_prompt has 2 entries but prompt has 3"):
        generate(pipe, prompt=["a", "b", "c"], negative_prompt=["x", "y"])
    with pytest.raises(ValueError, match="prompt is an empty list"):
        generate(pipe, prompt=[])
    with pytest.raises(ValueError, match="prompt is missing"):
        generate(pipe, num_inference_steps=2)
    assert calls == []
    assert generate(pipe, prompt=["a", "b"], generator=g, negative_prompt="x") == "frames"
    assert generate(pipe, prompt="a", num_videos_per_prompt=2, generator=g) == "frames"
