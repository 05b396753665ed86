"""``OmniDiffusionSamplingParams`` and ``OmniRequestOutput``: vllm-omni's names and the fields
of theirs that a diffusers pipeline call takes, so a vllm-omni script's
``OmniDiffusionSamplingParams(num_inference_steps=50)`` and ``outputs[0].images[0]`` run as
written. Plain Python: no torch (a ``generator`` given is a torch object the caller made)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["OmniDiffusionSamplingParams", "OmniRequestOutput"]


@dataclass
class OmniDiffusionSamplingParams:
    """What one ``Omni.generate`` call asks of the pipeline; ``None`` leaves a value to the
    pipeline's own default (vllm-omni's ``num_frames=1`` and ``guidance_scale=0.0`` defaults
    would override a video pipeline's: here they are None).

    - ``num_inference_steps``, ``guidance_scale``, ``guidance_scale_2`` (Wan 2.2's second
      expert), ``true_cfg_scale`` (Flux), ``height``, ``width``, ``num_frames``,
      ``max_sequence_length``: the pipeline call's arguments of those names.
    - ``seed``: each prompt's outputs start from ``torch.Generator("cpu").manual_seed(seed)``
      (prompt i: ``seed + i``); None: a seed drawn per ``generate`` call. ``generator``: a
      torch generator (or one per prompt) used instead.
    - ``num_outputs_per_prompt``: outputs per prompt (``num_videos_per_prompt`` or
      ``num_images_per_prompt`` of the call).
    - ``fps``: kept on the output (``metrics["fps"]``) for whoever writes the video.
    - ``extra_args``: any other argument of the pipeline call, passed as given.
    """

    num_inference_steps: int = 50
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    true_cfg_scale: float | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    max_sequence_length: int | None = None
    seed: int | None = None
    generator: Any = None
    num_outputs_per_prompt: int = 1
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_inference_steps", "num_outputs_per_prompt"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"OmniDiffusionSamplingParams.{name} must be an int >= 1, got {value!r}")
        for name in ("height", "width", "num_frames", "fps", "max_sequence_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"OmniDiffusionSamplingParams.{name} must be None or an int >= 1, got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"OmniDiffusionSamplingParams.seed must be None or an int, got {self.seed!r}")
        if not isinstance(self.extra_args, dict):
            raise TypeError(f"OmniDiffusionSamplingParams.extra_args must be a dict, got {type(self.extra_args).__name__}")

    def clone(self) -> OmniDiffusionSamplingParams:
        import copy

        return copy.deepcopy(self)


@dataclass
class OmniRequestOutput:
    """One prompt's outputs, as vllm-omni's diffusion outputs: ``images`` holds one entry per
    output of the prompt, each a float32 NumPy array on [0, 1] as diffusers'
    ``output_type="np"`` gives it: (frames, height, width, 3) for a video pipeline
    (``final_output_type="video"``), (height, width, 3) for an image pipeline ("image")."""

    request_id: str = ""
    finished: bool = True
    final_output_type: str = "video"
    images: list[Any] = field(default_factory=list)
    prompt: Any = None
    latents: Any = None
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def num_images(self) -> int:
        return len(self.images)
