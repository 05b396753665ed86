"""Writing what a pipeline made: frames in [0, 1] (``output_type="np"``) to a video, an image
or the raw array. Video goes through diffusers' ``export_to_video`` (imageio with the ffmpeg
binary that imageio-ffmpeg ships, so no system ffmpeg is needed)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SUFFIXES", "check_suffix", "write_output"]

# What each output kind may be written as.
SUFFIXES: dict[str, tuple[str, ...]] = {"video": (".mp4", ".gif", ".npy"), "image": (".png", ".npy")}


def check_suffix(output: Path, kind: str, class_name: str) -> str | None:
    """None when ``output`` suits a pipeline that makes ``kind``, else the error message."""
    suffix = output.suffix.lower()
    allowed = SUFFIXES[kind]
    if suffix in allowed:
        return None
    every = sorted({s for kinds in SUFFIXES.values() for s in kinds})
    if suffix in every:
        return (f"--output {output}: {suffix} is not an output of {class_name}, which makes "
                f"{'a video' if kind == 'video' else 'an image'}; use {', '.join(allowed)}")
    return f"--output {output}: unsupported suffix {suffix or '(none)'!r}; use {', '.join(allowed)}"


def _to_uint8(frames: np.ndarray) -> np.ndarray:
    import numpy as np

    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def write_output(frames: np.ndarray, output: Path, fps: int) -> None:
    """Writes ``frames`` ((F, H, W, 3) for video, (H, W, 3) for an image, values in [0, 1])."""
    import numpy as np

    output.parent.mkdir(parents=True, exist_ok=True)
    suffix = output.suffix.lower()
    if suffix == ".npy":
        np.save(output, frames)
        return
    if suffix == ".png":
        from PIL import Image

        Image.fromarray(_to_uint8(frames)).save(output)
        return
    if suffix == ".gif":
        from diffusers.utils import export_to_gif
        from PIL import Image

        export_to_gif([Image.fromarray(f) for f in _to_uint8(frames)], str(output), fps=fps)
        return
    from diffusers.utils import export_to_video
    from PIL import Image

    # As PIL images: export_to_video scales float arrays itself (truncating) and would scale
    # uint8 arrays again; images go in as they are, with our rounding.
    export_to_video([Image.fromarray(f) for f in _to_uint8(frames)], str(output), fps=fps)
