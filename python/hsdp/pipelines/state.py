"""What ``load_pipeline`` did to a pipeline, for reports: ``pipeline_state(pipe)``.

Per component: its role, whether it is sharded, and how many of its parameters' elements
and bytes exist in the whole model versus on this rank outside a forward (``local_*``: this
rank's shard of every unit plus anything kept whole). A sharded component's local counts are
about 1/S of its whole ones (S the shard size), never more than that plus each unit's
alignment padding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .components import Role


@dataclasses.dataclass(frozen=True)
class ComponentState:
    name: str
    class_name: str
    role: Role
    sharded: bool
    units: int
    elements: int  # every parameter of the whole model
    local_elements: int  # what this rank holds outside a forward
    bytes: int  # the whole model, in the dtypes it is stored in
    local_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PipelineState:
    """``pipe._hsdp``: the job, the parallel layout and each component's footprint."""

    world_size: int
    rank: int
    config: Any  # the DiffusionParallelConfig (None: no parallelism asked for)
    groups: Any  # hsdp.parallel.ParallelGroups
    hsdp_config: Any  # the HSDPInferenceConfig the sharded components use, or None
    components: dict[str, ComponentState]
    cfg_split: Any = None  # the CFG splitter installed on the transformers, if any
    lockstep: Any = None  # data parallel over sharded models: their shard group's ballot (engine/lockstep.py)
    vae: Any = None  # the VAE's tiles spread over ranks (hsdp.pipelines.vae.TileSpread), if asked for
    caches: Any = None  # per transformer: its step cache's watch (hsdp.pipelines.cache.CacheWatch)

    @property
    def vae_ranks(self) -> int:
        """How many ranks of each request decode (the first ones): 1, or vae_patch_parallel_size."""
        return self.vae.n if self.vae is not None and self.vae.tiled else 1

    @property
    def sharded(self) -> list[str]:
        return [n for n, c in self.components.items() if c.sharded]

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "config": self.config.to_dict() if self.config is not None else None,
            "ulysses_degree": self.groups.ulysses_degree,
            "ring_degree": self.groups.ring_degree,
            "cfg_degree": self.groups.cfg_degree,
            "data_parallel_size": self.groups.dp_degree,
            "sharded": self.sharded,
            "components": {n: c.as_dict() for n, c in self.components.items()},
        }


def _overlap(lo: int, hi: int, a: int, b: int) -> int:
    return max(0, min(hi, b) - max(lo, a))


def component_state(name: str, class_name: str, role: Role, model: Any) -> ComponentState:
    """Counts for a torch module, sharded by hsdp or not (buffers are not counted)."""
    ctx = getattr(model, "_hsdp_context", None)
    if ctx is None:
        params = list({id(p): p for p in model.parameters()}.values())
        n = sum(p.numel() for p in params)
        b = sum(p.numel() * p.element_size() for p in params)
        return ComponentState(name, class_name, role, False, 0, n, n, b, b)
    elements = local_elements = nbytes = local_bytes = 0
    rank = ctx.mesh.shard_group.rank
    held: set[int] = set()
    for st in ctx.units:
        u = st.unit
        lo, hi = rank * u.chunk_bytes, (rank + 1) * u.chunk_bytes
        for off, nb, dt in zip(u.offsets, u.nbytes, st.storage_dtypes):
            mine = _overlap(lo, hi, off, off + nb)
            elements += nb // dt.itemsize
            nbytes += nb
            local_elements += mine // dt.itemsize
            local_bytes += mine
        held.update(id(p) for p in st.params)
    for p in {id(p): p for p in model.parameters()}.values():
        if id(p) not in held:  # kept whole on every rank (unshardable or ignored)
            elements += p.numel()
            local_elements += p.numel()
            nbytes += p.numel() * p.element_size()
            local_bytes += p.numel() * p.element_size()
    return ComponentState(name, class_name, role, True, len(ctx.units), elements, local_elements, nbytes, local_bytes)


def pipeline_state(pipe: Any) -> PipelineState:
    """The :class:`PipelineState` of a pipeline ``hsdp.pipelines.load_pipeline`` built."""
    state = getattr(pipe, "_hsdp", None)
    if not isinstance(state, PipelineState):
        raise ValueError(f"{type(pipe).__name__} was not loaded by hsdp.pipelines.load_pipeline (it has no _hsdp state)")
    return state
