"""Step caches (diffusers' enable_cache) under hsdp's parallel modes: the frames and each
expert's computed and skipped forwards equal the stock single-process pipeline's under the same
cache, and the flags that make them."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")  # torch is an optional dependency; make test installs it

from mpirun import run_ranks  # noqa: E402

from hsdp.cli.cache_spec import parse_cache  # noqa: E402
from hsdp.testing.tiny_pipeline import make_tiny_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def wan22(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_pipeline(tmp_path_factory.mktemp("cache") / "wan22", "wan22", seed=0)


def test_two_ranks_first_block_taylorseer_and_magcache_decide_as_one_process(wan22):
    """First-block cache on HSDP 1x2, Ulysses 2 (where one rank's tokens alone would have
    decided otherwise: asserted) and 2 data parallel lanes with different prompts (the lanes
    decide apart and still gather together); TaylorSeer and MagCache on 1x2 and Ulysses 2."""
    cases = ["fbc-1x2", "fbc-ulysses2", "fbc-dp2", "taylor-1x2", "taylor-ulysses2", "mag-1x2", "mag-ulysses2"]
    out = run_ranks(2, "tests/cache_worker.py", str(wan22), *cases, timeout=600).stdout
    for case in cases:
        assert out.count(f"rank 0: {case} ok") == 1 and out.count(f"rank 1: {case} ok") == 1, out


def test_four_ranks_ulysses_with_cfg_branches_deciding_apart(wan22):
    out = run_ranks(4, "tests/cache_worker.py", str(wan22), "fbc-ulysses2-cfg2", timeout=600).stdout
    assert out.count("fbc-ulysses2-cfg2 ok") == 4, out


def test_cache_flags_parse_to_diffusers_configs_and_bad_ones_name_the_part(tmp_path):
    fbc = parse_cache("first-block:0.1")
    assert type(fbc).__name__ == "FirstBlockCacheConfig" and fbc.threshold == 0.1
    ts = parse_cache("taylorseer:4:2:1")
    assert (ts.cache_interval, ts.disable_cache_before_step, ts.max_order) == (4, 2, 1)
    assert parse_cache("taylorseer").cache_interval == 5  # diffusers' defaults
    mag = parse_cache("magcache:0.06", num_inference_steps=10, model="FluxPipeline")
    assert mag.threshold == 0.06 and len(mag.mag_ratios) == 10
    ratios = tmp_path / "ratios.json"
    ratios.write_text("[1.0, 0.95, 0.9]")
    assert len(parse_cache(f"magcache:0.1:{ratios}", num_inference_steps=6, model="WanPipeline").mag_ratios) == 6
    bad = [
        ("lru:3", "the kind must be one of first-block, taylorseer, magcache"),
        ("first-block", "first-block takes one threshold"),
        ("first-block:x", "first-block's threshold must be a float, got 'x'"),
        ("first-block:-1", "must be >= 0"),
        ("taylorseer:0", "the interval must be >= 1"),
        ("taylorseer:1:2:3:4", "at most INTERVAL:WARMUP:ORDER"),
        ("magcache:0.1", "needs the model's ratios"),
        (f"magcache:0.1:{tmp_path / 'none.json'}", "cannot read the ratios file"),
    ]
    for text, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_cache(text, model="WanPipeline")


def test_caches_that_assume_one_rank_holds_the_request_are_refused_under_split_work():
    from diffusers import PyramidAttentionBroadcastConfig
    from torch_models import make_wan, wan_inputs

    from hsdp.pipelines.cache import CacheWatch

    args, kwargs = wan_inputs()
    for sp_group, shared in ((object(), False), (None, True)):  # sequence parallel; CFG or data parallel
        model = make_wan(0)
        model.enable_cache(PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                                           current_timestep_callback=lambda: 500))
        CacheWatch(model, "transformer", sp_group, shared)
        with pytest.raises(NotImplementedError, match="Pyramid Attention Broadcast on 'transformer' .* under "
                                                      "sequence, CFG or data parallel is not built"):
            model(*args, **kwargs)
    model = make_wan(0)  # alone with HSDP (every rank the same request): it runs as it is
    model.enable_cache(PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                                       current_timestep_callback=lambda: 500))
    CacheWatch(model, "transformer", None, False)
    with torch.inference_mode():
        model(*args, **kwargs)


def test_a_cache_enabled_again_is_watched_again():
    """hsdp serve switches caches between jobs (disable_cache, enable_cache): a new hook may get a
    freed hook's id(), so the watch marks the hooks themselves. Each cycle's two forwards are counted."""
    import gc

    from diffusers import FirstBlockCacheConfig
    from torch_models import make_wan, wan_inputs

    from hsdp.pipelines.cache import CacheWatch

    model = make_wan(0)
    watch = CacheWatch(model, "transformer", None, False)
    args, kwargs = wan_inputs()
    with torch.inference_mode():
        for cycle in range(12):
            model.enable_cache(FirstBlockCacheConfig(threshold=0.2))
            watch.counts.reset()
            with model.cache_context("cond"):
                model(*args, **kwargs)
                model(*args, **kwargs)
            assert watch.counts.computed + watch.counts.skipped == 2, (cycle, watch.counts)
            model.disable_cache()
            gc.collect()
