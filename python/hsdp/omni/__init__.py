"""vllm-omni's offline API over hsdp: :class:`Omni` starts the ranks a
``DiffusionParallelConfig`` needs from one plain Python process and runs each ``generate``
there; :class:`OmniDiffusionSamplingParams` and :class:`OmniRequestOutput` are vllm-omni's
names for a request's parameters and a prompt's outputs. No torch is imported here (nor in the
caller's process at all). See docs/pipelines.md, "Omni: from one Python process"."""

from __future__ import annotations

from .engine import Omni
from .params import OmniDiffusionSamplingParams, OmniRequestOutput

__all__ = ["Omni", "OmniDiffusionSamplingParams", "OmniRequestOutput"]
