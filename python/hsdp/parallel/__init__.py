"""Sequence (Ulysses) and CFG parallelism, over the ranks ``DiffusionParallelConfig`` lays out.

Rank layout (HSDP adds no ranks; it shards over these same ones, see docs/launching.md):

    world = cfg x ring x ulysses, ulysses innermost:  rank = c * (ring * ulysses) + r * ulysses + u
    sequence-parallel group of a rank: the ranks with its c   (consecutive ranks; s = r * ulysses + u)
    Ulysses group:                     the ranks with its c, r (consecutive ranks)
    ring group:                        the ranks with its c, u (strided by ulysses: yunchang's layout)
    CFG group of a rank:               the ranks with its s   (one per branch)

- **Ulysses.** Each rank of a sequence-parallel group holds 1/ulysses of the tokens. Before
  self-attention an all-to-all turns (my tokens, all heads) into (all tokens, my heads);
  attention runs over the whole sequence for those heads; a second all-to-all turns the
  result back. Everything else in a block is token-wise and runs on the local tokens.
  Cross-attention needs no exchange: its keys are the text, whole on every rank.
- **CFG.** The two halves of a CFG group compute the conditional and the unconditional
  branch; the noise predictions are all-gathered, so every rank applies the same guidance.
- **Ring** (``ring_degree > 1``, :mod:`hsdp.ring`): each rank of a ring group keeps its
  queries; the key/value blocks pass around the ring by send/recv and the partial results
  merge through the softmax log-sum-exp. With Ulysses too (USP) the all-to-all runs first,
  ring attention inside, then the reverse all-to-all. ``ParallelGroups.sp`` is then a
  :class:`hsdp.ring.USP`, with the interface of :class:`Ulysses` the reference model uses.
"""

from __future__ import annotations

from .cfg import cfg_combine
from .groups import SINGLE, ParallelGroups, apply_sequence_parallel, init_parallel_groups
from .split import TokenSplit
from .ulysses import Ulysses

__all__ = ["SINGLE", "ParallelGroups", "TokenSplit", "Ulysses", "apply_sequence_parallel", "cfg_combine",
           "init_parallel_groups"]
