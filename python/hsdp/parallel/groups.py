"""The data-parallel lanes, and the sequence-parallel and CFG groups of a rank, split from
the world as ``DiffusionParallelConfig`` lays them out, and the reference model's sequence split.

Layout: world rank = lane * L + c * SP + s, with L = cfg * SP the lane's size, SP = ulysses *
ring the sequence-parallel size, c the CFG branch and s the rank in the sequence group. Every
group is split within a lane, so the lanes never exchange activations; only the HSDP shard
group spans them (its gathers)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .ulysses import Ulysses


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """The sequence-parallel and CFG groups of this rank (None where the degree is 1)."""

    ulysses_degree: int
    cfg_degree: int
    ulysses_rank: int
    cfg_rank: int
    sp: Any | None  # Ulysses, or hsdp.ring.USP when ring_degree > 1
    cfg: Any | None
    ring_degree: int = 1
    ring_rank: int = 0
    dp_degree: int = 1  # data-parallel lanes
    dp_rank: int = 0    # this rank's lane
    lane_rank: int = 0  # this rank within its lane (0: the lane's leader)

    @property
    def combined(self) -> bool:
        return self.ulysses_degree > 1 or self.cfg_degree > 1 or self.ring_degree > 1

    def describe(self) -> str:
        parts = []
        if self.ulysses_degree > 1:
            parts.append(f"ulysses {self.ulysses_rank}/{self.ulysses_degree}")
        if self.ring_degree > 1:
            parts.append(f"ring {self.ring_rank}/{self.ring_degree}")
        if self.cfg_degree > 1:
            parts.append(f"cfg branch {self.cfg_rank}/{self.cfg_degree}")
        if self.dp_degree > 1:
            parts.insert(0, f"lane {self.dp_rank}/{self.dp_degree}")
        return ", ".join(parts) or "no sequence or CFG parallelism"


SINGLE = ParallelGroups(ulysses_degree=1, cfg_degree=1, ulysses_rank=0, cfg_rank=0, sp=None, cfg=None)
"""One rank computing everything: no sequence split, both CFG branches here."""


def init_parallel_groups(config: Any, world: Any) -> ParallelGroups:
    """Split `world` into the sequence-parallel and CFG groups `config` (a
    ``DiffusionParallelConfig``) declares. Collective: every rank calls it."""
    ring = config.ring_degree
    if ring > 1:
        return _init_usp_groups(config, world)
    sp, cfg = config.ulysses_degree, config.cfg_parallel_size
    config.check_world(world.size)  # ValueError naming both sizes and the launch command
    lane_size, lanes = sp * cfg, config.lanes
    d, local = divmod(world.rank, lane_size)
    lane = {"dp_degree": lanes, "dp_rank": d, "lane_rank": local}
    if lane_size == 1:  # standalone HSDP, lanes of one rank, or nothing parallel: no group to split off
        return dataclasses.replace(SINGLE, **lane)
    config.require_supported()  # NotImplementedError naming each degree hsdp.engine.built lists as not built
    u, c = local % sp, local // sp
    # Both splits on every rank, in this order: a split is a collective over the world.
    sp_group = world.split(color=d * cfg + c, key=u)
    cfg_group = world.split(color=d * sp + u, key=c)
    return ParallelGroups(
        ulysses_degree=sp,
        cfg_degree=cfg,
        ulysses_rank=u,
        cfg_rank=c,
        sp=Ulysses(sp_group) if sp > 1 else None,
        cfg=cfg_group if cfg > 1 else None,
        **lane,
    )


def _init_usp_groups(config: Any, world: Any) -> ParallelGroups:
    """The groups of ring_degree > 1, alone or with Ulysses and CFG (the layout above)."""
    from .ring import USP, Ring

    uly, ring, cfg = config.ulysses_degree, config.ring_degree, config.cfg_parallel_size
    sp = uly * ring
    config.check_world(world.size)
    config.require_supported()  # NotImplementedError naming each degree hsdp.engine.built lists as not built
    d, local = divmod(world.rank, sp * cfg)
    s, c = local % sp, local // sp
    u, r = s % uly, s // uly
    # Every split on every rank, in this order: each is a collective over the world.
    sp_group = world.split(color=d * cfg + c, key=s)
    uly_group = world.split(color=(d * cfg + c) * ring + r, key=u)
    ring_group = world.split(color=(d * cfg + c) * uly + u, key=r)
    cfg_group = world.split(color=d * sp + s, key=c)
    usp = USP(sp_group, Ulysses(uly_group) if uly > 1 else None, Ring(ring_group))
    return ParallelGroups(
        ulysses_degree=uly,
        cfg_degree=cfg,
        ulysses_rank=u,
        cfg_rank=c,
        sp=usp,
        cfg=cfg_group if cfg > 1 else None,
        ring_degree=ring,
        ring_rank=r,
        dp_degree=config.lanes,
        dp_rank=d,
        lane_rank=local,
    )


def apply_sequence_parallel(model: Any, sp: Any) -> Any:
    """Make a reference :class:`~hsdp.models.VideoDiT` run its tokens split over `sp` (a
    :class:`Ulysses`, or a :class:`hsdp.ring.USP` for ring attention): the
    model splits them after the patch embedding, every self-attention exchanges them, and
    the output is gathered whole on every rank. ``None`` turns it off. Returns the model."""
    from ..models.dit import Attention, VideoDiT

    if not isinstance(model, VideoDiT):
        raise TypeError(
            f"apply_sequence_parallel takes a reference hsdp.models.VideoDiT, got {type(model).__name__}; "
            "for a diffusers transformer use hsdp.parallel_torch.apply_sequence_parallel_torch"
        )
    if sp is not None:
        sp.check_heads(model.config.num_heads)
    object.__setattr__(model, "_hsdp_ulysses", sp)
    for block in model.blocks:
        attn = block.self_attn
        assert isinstance(attn, Attention)
        object.__setattr__(attn, "_hsdp_ulysses", sp)
    return model
