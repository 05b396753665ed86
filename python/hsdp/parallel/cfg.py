"""The CFG exchange: the two guidance branches, computed on two ranks, all-gathered and
combined the same on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..adapters import NUMPY

if TYPE_CHECKING:
    from ..adapters import TensorAdapter
    from .groups import ParallelGroups


def cfg_combine(
    groups: ParallelGroups, branch: Callable[[int], Any], guidance_scale: float, adapter: TensorAdapter | None = None
) -> Any:
    """Classifier-free guidance, uncond + scale * (cond - uncond) in float32, the same on
    every rank, in ``adapter``'s tensors (None: NumPy arrays; ``hsdp.parallel_torch`` passes
    the torch adapter).

    `branch(0)` computes the conditional prediction and `branch(1)` the unconditional one.
    With a CFG group each rank computes its own branch and the two are all-gathered; without
    one this rank computes both."""
    ad = adapter or NUMPY
    if groups.cfg is None:
        cond, uncond = ad.to_float32(branch(0)), ad.to_float32(branch(1))
    else:
        both = ad.all_gather(groups.cfg, ad.to_float32(branch(groups.cfg_rank)))
        cond, uncond = both[0], both[1]
    # a Python float: the product stays float32 in both frameworks
    return ad.to_float32(uncond + float(guidance_scale) * (cond - uncond))
