"""``load_pipeline``: a stock diffusers pipeline whose transformers and text encoders are
sharded rank-locally by HSDP, run with the Ulysses and CFG parallelism one
``DiffusionParallelConfig`` declares.

Order of work, the same on every rank:

1. Check everything cheap: the config against the world, the folder (``model_index.json``,
   each component's folder and class, shard conditions, safetensors headers), the parallel
   modes against the pipeline and model classes. The ranks agree on the outcome, so a bad
   input is one clear error on every rank, before any weight is read.
2. Split the world into the Ulysses, ring and CFG groups (``hsdp.parallel.init_parallel_groups``).
3. Each sharded component: built empty (``accelerate.init_empty_weights()``: meta
   parameters, real buffers), then ``hsdp.load_model_sharded`` streams it, each rank reading
   only its own bytes; the peak is this rank's shards plus a block.
4. ``<PipelineClass>.from_pretrained(path, <component>=<prebuilt>, ..., dtype=...)`` (the
   class ``model_index.json`` names) loads the rest whole (VAE, tokenizers, scheduler, image processors) and builds the
   pipeline class the folder names.
5. Ulysses / ring attention (USP) on every transformer, where its context-parallel plan says; the CFG split (:mod:`hsdp.pipelines.cfg`) on every
   transformer; the VAE's tiles over ``vae_patch_parallel_size`` ranks (:mod:`hsdp.pipelines.vae`); the
   state for reports on ``pipe._hsdp``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..world import distributed
from ..parallel import SINGLE, ParallelGroups, init_parallel_groups
from .cfg import CFGSplit, guidance_probe, record_calls
from .components import Component, pipeline_class, read_components, read_model_index
from .conditions import describe
from .state import PipelineState, component_state

log = logging.getLogger("hsdp")

_PARAM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _agree(world: Any, err: BaseException | None, step: str) -> None:
    """Raise on every rank when `err` happened on any (the streaming loader's agreement)."""
    from ..checkpoint.stream import _Agreement

    _Agreement(world)(err, 0, step)


def _check_modes(config: Any, pipe_cls: type, components: list[Component]) -> None:
    """The parallel modes this pipeline can run, refused here with the reason."""
    if config is None:
        return
    config.require_supported()  # TP, PP, DP, EP: NotImplementedError naming each
    transformers = [c for c in components if c.role == "transformer"]
    if config.sequence_parallel_size > 1:  # Ulysses, ring attention, or both (USP): by the model's plan
        from ..parallel.context import no_plan_message, plan_of

        what = f"sequence parallel (ulysses_degree={config.ulysses_degree}, ring_degree={config.ring_degree})"
        for c in transformers:
            if plan_of(c.cls) is None:
                raise NotImplementedError(f"component '{c.name}': " + no_plan_message(c.class_name, what))
            heads = c.cls.load_config(c.folder).get("num_attention_heads")
            if isinstance(heads, int) and heads % config.ulysses_degree:
                raise ValueError(
                    f"ulysses_degree={config.ulysses_degree} splits the attention heads across its ranks, and "
                    f"component '{c.name}' ({c.class_name}, {c.folder / 'config.json'}) has num_attention_heads="
                    f"{heads}, not divisible by it; choose a ulysses_degree that divides {heads} (ring_degree "
                    f"splits the tokens instead)")
    if config.cfg_parallel_size > 1:
        if config.cfg_parallel_size != 2:
            raise ValueError(f"cfg_parallel_size must be 1 or 2 (cond and uncond), got {config.cfg_parallel_size}")
        if guidance_probe(pipe_cls) is None:
            raise NotImplementedError(
                f"CFG parallel (cfg_parallel_size=2) needs to know, before a step's first transformer call, "
                f"whether the step runs guidance; hsdp knows that for WanPipeline, WanImageToVideoPipeline and "
                f"FluxPipeline, not for {pipe_cls.__name__} (add a probe to hsdp.pipelines.cfg.GUIDANCE_PROBES)"
            )


def _one_dtype(torch_dtype: Any, dtype: Any) -> Any:
    """``torch_dtype=`` and ``dtype=`` (diffusers' current keyword) name one setting: either,
    both alike, or neither (bfloat16)."""
    if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
        raise ValueError(f"load_pipeline got torch_dtype={torch_dtype!r} and dtype={dtype!r}: they name the same "
                         "setting (dtype is diffusers' current name), give one")
    chosen = torch_dtype if torch_dtype is not None else dtype
    return torch.bfloat16 if chosen is None else chosen


def _folder_of(path: Any, revision: str | None, world: Any) -> Path:
    """The pipeline folder: ``path`` itself, or the cached snapshot of the hub id it names
    (every rank the one snapshot rank 0 resolved: :func:`hsdp.hub.resolve_model_on_ranks`)."""
    from ..hub import resolve_model_on_ranks

    return resolve_model_on_ranks(os.fspath(path), revision, world)


def _is_transformer(name: str, module: Any) -> bool:
    from diffusers import ModelMixin

    return isinstance(module, ModelMixin) and (name.startswith("transformer") or "Transformer" in type(module).__name__)


def _empty(c: Component, keep_fp32: bool) -> Any:
    """The component's model with meta parameters and real buffers, its units declared."""
    import accelerate

    with accelerate.init_empty_weights():
        if c.library == "diffusers":
            model = c.cls.from_config(c.cls.load_config(c.folder))
        else:
            from transformers import AutoConfig

            model = c.cls(AutoConfig.from_pretrained(c.folder))
    if c.library == "transformers":
        # transformers ties weights (T5's encoder.embed_tokens to shared) when it loads; the
        # checkpoint holds one name, so tie the empty model the same way first
        model.tie_weights()
        # transformers keeps _keep_in_fp32_modules in float32 for float16 only, and
        # _keep_in_fp32_modules_strict for bfloat16 too; hsdp keeps what the instance names
        # for any narrower dtype, so name what transformers would keep
        strict = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        loose = set(getattr(model, "_keep_in_fp32_modules", None) or ())
        model._keep_in_fp32_modules = (strict | loose) if keep_fp32 else strict
    model._hsdp_shard_conditions = list(c.conditions)  # on the instance: the stock class is enough
    return model.eval()


def _key_map(model: Any) -> Any:
    """Checkpoint names to the model's: as is, or without a first level the model lacks
    (transformers 5's CLIPTextModel has no ``text_model.``, its checkpoints do). A name that
    fits neither stays as is, for the loader to report."""
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers()}

    def rename(name: str) -> str:
        if name in known:
            return name
        tail = name.partition(".")[2]
        return tail if tail in known else name

    return rename


def _load_sharded(c: Component, hsdp_cfg: Any, device: Any, dtype: torch.dtype, progress: bool) -> Any:
    from ..checkpoint import load_model_sharded  # lazy, as the root's re-export was

    log.info("streaming '%s' (%s) sharded, units %s", c.name, c.class_name, describe(c.conditions))
    model = _empty(c, keep_fp32=dtype == torch.float16)
    key_map = _key_map(model) if c.library == "transformers" else None
    return load_model_sharded(model, c.folder, hsdp_cfg, target_device=device, progress=progress,
                              key_map=key_map)


def load_pipeline(
    path: str | os.PathLike[str],
    parallel_config: Any = None,
    *,
    torch_dtype: torch.dtype | None = None,
    dtype: torch.dtype | None = None,
    device: Any = None,
    shard_text_encoders: bool = True,
    progress: bool = True,
    **kwargs: Any,
) -> Any:
    """Load the diffusers pipeline folder `path` with its models sharded by HSDP.

    Returns the stock pipeline object (the class ``DiffusionPipeline.from_pretrained(path)``
    gives), so ``pipe(prompt=..., generator=..., output_type=...)`` is diffusers' own call;
    run it on every rank (see :func:`hsdp.pipelines.generate`).

    - ``parallel_config``: a ``DiffusionParallelConfig``. With ``use_hsdp=True`` every
      transformer component, and every text encoder unless ``shard_text_encoders=False``,
      is streamed rank-locally into HSDP units (the registry in
      :mod:`hsdp.pipelines.conditions` says which submodules); None or ``use_hsdp=False``
      loads them whole. Its Ulysses and ring degrees (any transformer with a context-parallel
      plan, :mod:`hsdp.parallel.context`) and CFG parallel size apply either way.
    - ``torch_dtype``: float32, bfloat16 (the default) or float16; what the sharded models are
      stored and computed in (``_keep_in_fp32_modules`` stay float32) and what diffusers loads
      the rest in. ``dtype=`` is the same (diffusers' current name); giving both, different, is
      an error.
    - ``path``: a folder, or a Hugging Face hub id (``org/name``) resolved from the local cache
      (downloaded where allowed) by :func:`hsdp.hub.resolve_model_on_ranks`, every rank the same
      snapshot; ``revision=`` (in ``kwargs``) picks the hub revision.
    - ``device``: where the models run (None: the CPU); ``"cuda"`` shards onto each rank's GPU.
    - ``progress``: log each sharded component's load on rank 0.
    - ``kwargs``: passed to the pipeline class's ``from_pretrained`` (a component given there
      is used as is, not loaded; a transformer given there still gets Ulysses and the CFG split).

    Every rank checks the folder and the config first and they agree, so a bad input raises
    the same clear error on every rank before any weight is read.
    """
    from ..engine.config import DiffusionParallelConfig

    torch_dtype = _one_dtype(torch_dtype, dtype)
    world = distributed.world_for(torch.device(device).type if device is not None else None, f"device {device!r}")
    folder = _folder_of(path, kwargs.pop("revision", None), world)

    err: BaseException | None = None
    components: list[Component] = []
    pipe_cls: type = type(None)
    hsdp_cfg = None
    use_hsdp = False
    try:
        if parallel_config is not None and not isinstance(parallel_config, DiffusionParallelConfig):
            raise TypeError(f"parallel_config must be a DiffusionParallelConfig or None, got {type(parallel_config).__name__}")
        if torch_dtype not in _PARAM_DTYPES:
            raise ValueError(f"torch_dtype must be one of {', '.join(map(str, _PARAM_DTYPES))}, got {torch_dtype!r}")
        if parallel_config is not None:
            parallel_config.check_world(world.size)
            use_hsdp = parallel_config.use_hsdp
        pipe_cls = pipeline_class(folder, read_model_index(folder))
        given = {k for k in kwargs if not k.startswith("_")}
        components = [c for c in read_components(folder, shard_text_encoders, use_hsdp) if c.name not in given]
        _check_modes(parallel_config, pipe_cls, components)
        if use_hsdp:
            hsdp_cfg = parallel_config.to_hsdp_config(param_dtype=_PARAM_DTYPES[torch_dtype])
    except Exception as e:  # any failure here, on any rank, must reach every rank (no rank left waiting)
        err = e
    # this rank's own error, or a RuntimeError naming the rank that failed and why
    _agree(world, err, f"checking pipeline folder '{folder}'")
    groups: ParallelGroups = init_parallel_groups(parallel_config, world) if parallel_config is not None else SINGLE

    prebuilt: dict[str, Any] = {}
    for c in components:
        if c.sharded:
            prebuilt[c.name] = _load_sharded(c, hsdp_cfg, device, torch_dtype, progress)
    # the folder's own class: DiffusionPipeline.from_pretrained would load a passed optional
    # component (Wan's transformer, transformer_2) from disk again and drop the one passed
    pipe = pipe_cls.from_pretrained(folder, **prebuilt, dtype=torch_dtype, **kwargs)
    for name, model in prebuilt.items():
        if getattr(pipe, name, None) is not model:
            raise RuntimeError(f"{pipe_cls.__name__}.from_pretrained did not keep the sharded '{name}' it was given")
    if device is not None:
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module) and name not in prebuilt:
                module.to(device)

    if world.rank != 0:
        pipe.set_progress_bar_config(disable=True)  # one progress bar per job, not per rank

    # a transformer passed in kwargs runs with the same parallel modes as the loaded ones
    transformers = [(n, m) for n, m in pipe.components.items() if _is_transformer(n, m)]
    if groups.sp is not None:
        from ..parallel.context import apply_sequence_parallel_torch

        for _, model in transformers:
            apply_sequence_parallel_torch(model, groups.sp)
    split = None
    if groups.cfg is not None:
        probe = guidance_probe(type(pipe))
        assert probe is not None  # _check_modes refused the others
        split = CFGSplit(pipe, groups, probe)
        record_calls(pipe, split.on_call)
        for _, model in transformers:
            split.install(model)

    lockstep = None
    if groups.dp_degree > 1:  # the lanes sharing a shard group gather in lockstep
        from .lanes import install_lockstep

        lockstep = install_lockstep(pipe, [prebuilt[c.name] for c in components if c.name in prebuilt])

    vae = None
    if parallel_config is not None and parallel_config.vae_patch_parallel_size > 1:
        from .vae import install

        # the ranks running one request: the world, or a data parallel lane (split: collective)
        group = world if groups.dp_degree == 1 else world.split(color=groups.dp_rank, key=groups.lane_rank)
        vae = install(pipe, group, parallel_config.vae_patch_parallel_size)

    from .cache import watch

    caches = watch(pipe, transformers, groups)  # step caches a user enables later decide per request

    states = {}
    for c in components:
        module = getattr(pipe, c.name, None)
        if isinstance(module, torch.nn.Module):
            states[c.name] = component_state(c.name, c.class_name, c.role, module)
    object.__setattr__(pipe, "_hsdp", PipelineState(world.size, world.rank, parallel_config, groups, hsdp_cfg,
                                                    states, split, lockstep, vae, caches))
    return pipe
