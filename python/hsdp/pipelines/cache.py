"""Step caches under hsdp's parallel modes: diffusers' cache hooks decide per request as one
process would, and never desync the ranks.

A step cache (diffusers' ``enable_cache``) decides per forward whether to skip blocks. Ranks
that share work must decide alike where they compute one request, and may decide apart where
they compute different ones:

- **Gathers never desync.** hsdp's unit hooks are torch forward pre-hooks; a diffusers cache
  hook replaces a block's ``forward`` and returns early, so a skipped block is still called:
  its gather runs and its unit gives the weights back at once. Every rank of a shard group
  therefore gathers every unit every forward, whatever each decided (CFG branches and data
  parallel lanes deciding apart included), in the recorded order the lockstep expects.
- [Note: one statistic per request] Under Ulysses or ring each rank holds a share of the
  tokens, and a statistic over "the hidden states" (first-block cache's relative change of
  the first block's residual) is then a statistic over that share: the ranks would decide
  differently, and the ones that compute would wait forever in an all-to-all the others
  skipped. hsdp replaces the hook's decision by the same statistic over the whole sequence:
  each rank's sums (and element counts) are all-gathered over its sequence-parallel group,
  so every rank of the request decides what the unsharded model decides.
- Caches whose decisions depend only on the step (TaylorSeer, MagCache with its ratios) need
  nothing: every rank counts the same steps.
- The others diffusers ships (FasterCache, Pyramid Attention Broadcast, SeaCache) are refused
  under sequence, CFG or data parallel with a ``NotImplementedError`` naming them; alone
  with HSDP (every rank computing the same request) they run as they are.

:func:`watch` installs a pre-hook on each transformer that finds cache hooks however they
were applied (``pipe.transformer.enable_cache(...)`` after ``load_pipeline``, or
``apply_first_block_cache``), once per forward. :class:`CacheCounts` counts each
transformer's computed and skipped forwards for the reports. Imported only by callers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

SYNCED = ("FBCHeadBlockHook",)  # decided by a statistic of the hidden states: reduced over the group
STEP_ONLY = ("TaylorSeerCacheHook", "MagCacheHeadHook", "MagCacheBlockHook", "FBCBlockHook")
ALONE_ONLY = {  # hook class -> the cache's name, for the refusal
    "FasterCacheDenoiserHook": "FasterCache", "FasterCacheBlockHook": "FasterCache",
    "PyramidAttentionBroadcastHook": "Pyramid Attention Broadcast",
    "SeaCacheHeadHook": "SeaCache", "SeaCacheBlockHook": "SeaCache",
}


@dataclasses.dataclass
class CacheCounts:
    """One transformer's cache decisions since load (or since :meth:`reset`)."""

    computed: int = 0  # forwards that ran every block
    skipped: int = 0  # forwards that skipped the blocks after the first (or the whole step)
    local_disagreed: int = 0  # forwards where this rank's share alone would have decided otherwise

    def reset(self) -> None:
        self.computed = self.skipped = self.local_disagreed = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _registries(model: Any) -> list[tuple[str, Any]]:
    return [(name, m._diffusers_hook) for name, m in model.named_modules() if getattr(m, "_diffusers_hook", None)]


def _synced_decision(hook: Any, group: Any, counts: CacheCounts) -> Callable[[torch.Tensor], bool]:
    """First-block cache's decision, its statistic over the whole sequence of `group`'s ranks
    (None: this rank holds it all); counted."""
    stock = hook._should_compute_remaining_blocks

    def decide(residual: torch.Tensor) -> bool:
        state = hook.state_manager.get_state()
        prev = state.head_block_residual
        if prev is None:
            counts.computed += 1
            return True
        # sum |r - p| and sum |p|: the unsharded means over the whole sequence are their ratio
        mine = torch.stack([(residual - prev).abs().sum(), prev.abs().sum()]).double().cpu().numpy()
        if group is None:
            every = mine[None]
        else:
            every = np.empty((group.size, 2), dtype=np.float64)
            group.all_gather(np.ascontiguousarray(mine), every)
        total = every.sum(axis=0)
        compute = bool(total[0] / total[1] > hook.threshold) if total[1] > 0 else True
        if group is not None and bool(mine[0] / mine[1] > hook.threshold if mine[1] > 0 else True) != compute:
            counts.local_disagreed += 1
        if compute:
            counts.computed += 1
        else:
            counts.skipped += 1
        return compute

    decide.__wrapped__ = stock  # type: ignore[attr-defined]
    return decide


class CacheWatch:
    """The cache hooks of one transformer, checked at each forward (see the module docstring)."""

    def __init__(self, model: Any, name: str, sp_group: Any, shared: bool) -> None:
        self.name = name
        self.sp_group = sp_group  # the sequence-parallel group (None: the rank holds every token)
        self.shared = shared  # ranks of this model's shard group compute other requests or branches
        self.counts = CacheCounts()
        self.handle = model.register_forward_pre_hook(self._check, prepend=True)

    def _check(self, model: Any, args: Any) -> None:
        for where, registry in _registries(model):
            for hook in list(registry.hooks.values()):
                if getattr(hook, "_hsdp_watched", False):  # on the hook: a new hook may reuse a freed one's id()
                    continue
                kind = type(hook).__name__
                if kind in ALONE_ONLY and (self.sp_group is not None or self.shared):
                    raise NotImplementedError(
                        f"{ALONE_ONLY[kind]} on '{self.name}' ({where}) under sequence, CFG or data parallel is not "
                        f"built: its decisions and cached tensors assume one rank holds the whole request; use "
                        f"first-block cache, TaylorSeer or MagCache (hsdp.pipelines.cache), or HSDP alone")
                if kind in SYNCED:
                    hook._should_compute_remaining_blocks = _synced_decision(hook, self.sp_group, self.counts)
                elif kind == "MagCacheHeadHook":
                    if hook.config.calibrate and self.sp_group is not None:
                        raise NotImplementedError(
                            f"MagCache calibration on '{self.name}' under sequence parallel is not built: its ratios "
                            f"would be measured over one rank's tokens; calibrate on one rank or with HSDP alone")
                    self._count_state(hook)
                elif kind == "TaylorSeerCacheHook" and not self._taylor_counted:
                    # TaylorSeer decides per module, alike; the first hooked module's decisions count steps
                    self._count_taylor(hook)
                    self._taylor_counted = True
                hook._hsdp_watched = True

    # -- counting step-only caches ------------------------------------------------------------

    _taylor_counted = False

    def _count_state(self, hook: Any) -> None:
        # the registry bound the hook's new_forward when it was registered: wrap that reference
        ref = hook.fn_ref
        stock = ref.forward
        counts = self.counts

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = stock(*args, **kwargs)
            if hook.state_manager.get_state().should_compute:
                counts.computed += 1
            else:
                counts.skipped += 1
            return out

        ref.forward = forward

    def _count_taylor(self, hook: Any) -> None:
        stock = hook._measure_should_compute
        counts = self.counts

        def measure() -> tuple[bool, Any]:
            compute, state = stock()
            if compute:
                counts.computed += 1
            else:
                counts.skipped += 1
            return compute, state

        hook._measure_should_compute = measure


def watch(pipe: Any, transformers: list[tuple[str, Any]], groups: Any) -> dict[str, CacheWatch]:
    """A :class:`CacheWatch` on each transformer of a loaded pipeline."""
    shared = groups.cfg_degree > 1 or groups.dp_degree > 1
    out = {}
    for name, model in transformers:
        spl = getattr(model, "_hsdp_sequence_parallel", None)
        out[name] = CacheWatch(model, name, spl.sp.group if spl is not None else None, shared)
    return out


def enable_cache(pipe: Any, config: Any) -> None:
    """``enable_cache(config)`` on every transformer of `pipe` (diffusers' own; hsdp's watch
    makes it decide per request), and the counts restarted."""
    from .state import PipelineState

    state = getattr(pipe, "_hsdp", None)
    names = list(state.caches) if isinstance(state, PipelineState) and state.caches else [
        n for n in ("transformer", "transformer_2") if getattr(pipe, n, None) is not None]
    for name in names:
        getattr(pipe, name).enable_cache(config)
        if isinstance(state, PipelineState) and state.caches:
            state.caches[name].counts.reset()


def cache_report(pipe: Any) -> dict[str, dict[str, int]] | None:
    """Per transformer: forwards computed and skipped by its step cache (None: no watch)."""
    from .state import PipelineState

    state = getattr(pipe, "_hsdp", None)
    if not isinstance(state, PipelineState) or not state.caches:
        return None
    return {name: w.counts.as_dict() for name, w in state.caches.items()}
