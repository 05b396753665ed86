"""Checking a request's fields against the served pipeline, before it becomes a job.

Everything here is plain Python (no torch, no FastAPI): a bad field raises
:class:`RequestError` naming the field, and the route answers 400 with that message. What
passes is a JSON-serialisable dict, the job's parameters, which rank 0 broadcasts to every
rank as it is.
"""

from __future__ import annotations

import base64
import io
import math
import secrets
from collections.abc import Mapping
from typing import Any

from hsdp.cli.folder import PipelineFolder

__all__ = ["LIMITS", "RequestError", "image_params", "video_params"]

# Upper bounds a request may ask for: beyond them a job would hold the server for hours.
LIMITS = {"width": 4096, "height": 4096, "num_frames": 1025, "num_inference_steps": 1000, "fps": 240, "n": 8,
          "input_reference_bytes": 32 << 20}
DEFAULT_FPS = 16
SEED_MAX = 2**63 - 1


class RequestError(ValueError):
    """A request field the server cannot take: ``param`` names it, the message says why."""

    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def _int(fields: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = fields.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
        raise RequestError(name, f"{name} must be an integer, got {value!r}")
    try:
        number = int(value) if not isinstance(value, str) else int(value.strip(), 10)
    except (TypeError, ValueError):
        raise RequestError(name, f"{name} must be an integer, got {value!r}") from None
    if number < low:
        raise RequestError(name, f"{name} must be >= {low}, got {number}")
    if high is not None and number > high:
        raise RequestError(name, f"{name} must be <= {high}, got {number}")
    return number


def _float(fields: Mapping[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise RequestError(name, f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RequestError(name, f"{name} must be a number, got {value!r}") from None
    if not (math.isfinite(number) and number > 0):
        raise RequestError(name, f"{name} must be a positive finite number, got {value!r}")
    return number


def _text(fields: Mapping[str, Any], name: str, required: bool) -> str | None:
    value = fields.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise RequestError(name, f"{name} is required (a non-empty string)")
        return None
    if not isinstance(value, str):
        raise RequestError(name, f"{name} must be a string, got {type(value).__name__}")
    return value


def _size(fields: Mapping[str, Any], folder: PipelineFolder) -> tuple[int | None, int | None]:
    """(width, height) from ``width``/``height`` or ``size`` "WxH"; each a multiple of what the VAE
    and the transformer's patch take."""
    width = _int(fields, "width", 1, LIMITS["width"])
    height = _int(fields, "height", 1, LIMITS["height"])
    size = fields.get("size")
    if size not in (None, "", "auto"):
        if width is not None or height is not None:
            raise RequestError("size", "give either size or width and height, not both")
        if not isinstance(size, str):
            raise RequestError("size", f"size must be a string 'WIDTHxHEIGHT', got {size!r}")
        parts = size.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise RequestError("size", f"size must be 'WIDTHxHEIGHT' (e.g. '832x480'), got {size!r}")
        width, height = (int(p) for p in parts)
        for name, value in (("width", width), ("height", height)):
            if not 1 <= value <= LIMITS[name]:
                raise RequestError("size", f"size {size!r}: {name} must be in 1..{LIMITS[name]}")
    m = folder.spatial_multiple
    for name, value in (("width", width), ("height", height)):
        if value is not None and value % m:
            param = "size" if size not in (None, "", "auto") else name
            raise RequestError(param, f"{name} {value} is not a multiple of {m} ({folder.describe_multiple()} "
                               f"of {folder.class_name}); try {max(1, round(value / m)) * m}")
    return width, height


def _seed(fields: Mapping[str, Any]) -> int:
    seed = _int(fields, "seed", 0, SEED_MAX)
    # A request without a seed gets one drawn here; the job reports it, so the run can be repeated.
    return secrets.randbelow(2**31) if seed is None else seed


def _check_image(data: bytes) -> None:
    if len(data) > LIMITS["input_reference_bytes"]:
        raise RequestError("input_reference", f"input_reference is {len(data)} bytes; at most "
                           f"{LIMITS['input_reference_bytes']} are taken", 413)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise RequestError("input_reference", f"input_reference is not an image PIL can read ({exc})") from None


# CFG parallel splits the two branches of classifier-free guidance across ranks: a job without
# guidance would have nothing to split.
_CFG_OFF = ("this server splits classifier-free guidance across ranks (--cfg-parallel-size 2), so every job "
            "must guide: ")


def _extra(fields: Mapping[str, Any], caches: tuple[str, ...]) -> str | None:
    """``extra_params`` (a JSON object, or its text in a form): ``cache``, one of the server's
    ``--cache`` specs or "none"; the job's step cache (default: the server's first)."""
    import json

    default = caches[0] if caches and caches[0] != "none" else None
    extra = fields.get("extra_params")
    if extra is None or extra == "":
        return default
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError as exc:
            raise RequestError("extra_params", f"extra_params must be a JSON object ({exc})") from None
    if not isinstance(extra, dict):
        raise RequestError("extra_params", f"extra_params must be a JSON object, got {type(extra).__name__}")
    unknown = sorted(set(extra) - {"cache"})
    if unknown:
        raise RequestError("extra_params", f"extra_params takes 'cache' only; unknown: {', '.join(map(repr, unknown))}")
    if "cache" not in extra:
        return default
    cache = extra["cache"]
    if cache in (None, "none"):
        return None
    if cache not in caches:
        allowed = ", ".join(repr(c) for c in dict.fromkeys((*caches, "none")))
        raise RequestError("extra_params", f"extra_params.cache {cache!r} is not one this server allows: {allowed} "
                           "(the server's --cache flags)")
    return str(cache)


def video_params(fields: Mapping[str, Any], image: bytes | None, folder: PipelineFolder,
                 cfg_parallel: bool = False, caches: tuple[str, ...] = ()) -> dict[str, Any]:
    """A ``POST /v1/videos`` form (its text fields, and the ``input_reference`` file's bytes)."""
    if folder.output != "video":
        raise RequestError(None, f"{folder.class_name} makes images, not videos: use POST /v1/images/generations", 404)
    params: dict[str, Any] = {"kind": "video", "prompt": _text(fields, "prompt", True)}
    params["negative_prompt"] = _text(fields, "negative_prompt", False)
    params["width"], params["height"] = _size(fields, folder)
    params["num_frames"] = _int(fields, "num_frames", 1, LIMITS["num_frames"])
    t = folder.temporal_factor
    if params["num_frames"] is not None and t and (params["num_frames"] - 1) % t:
        n = params["num_frames"]
        raise RequestError("num_frames", f"num_frames {n}: {folder.class_name}'s VAE needs num_frames - 1 to be a "
                           f"multiple of {t} (e.g. {(n - 1) // t * t + 1} or {((n - 1) // t + 1) * t + 1})")
    params["fps"] = _int(fields, "fps", 1, LIMITS["fps"]) or DEFAULT_FPS
    params["num_inference_steps"] = _int(fields, "num_inference_steps", 1, LIMITS["num_inference_steps"])
    params["guidance_scale"] = _float(fields, "guidance_scale")
    if cfg_parallel and params["guidance_scale"] is not None and params["guidance_scale"] <= 1.0:
        raise RequestError("guidance_scale", _CFG_OFF + f"guidance_scale {params['guidance_scale']:g} turns it off; "
                           "use a scale above 1")
    params["seed"] = _seed(fields)
    if image is not None and not folder.takes_image:
        raise RequestError("input_reference", f"input_reference is for image-to-video models; {folder.class_name} "
                           "is text-to-video")
    if image is None and folder.takes_image:
        raise RequestError("input_reference", f"{folder.class_name} is image-to-video: send the first frame as the "
                           "input_reference file")
    if image is not None:
        _check_image(image)
        params["image_b64"] = base64.b64encode(image).decode("ascii")
    params["cache"] = _extra(fields, caches)
    return params


def image_params(body: Any, folder: PipelineFolder, cfg_parallel: bool = False,
                 caches: tuple[str, ...] = ()) -> dict[str, Any]:
    """A ``POST /v1/images/generations`` JSON body. Flux guides through ``guidance_scale`` (the
    distilled embedding); ``true_cfg_scale`` above 1 with a ``negative_prompt`` turns on
    classifier-free guidance."""
    if folder.output != "image":
        raise RequestError(None, f"{folder.class_name} makes videos, not images: use POST /v1/videos", 404)
    if not isinstance(body, dict):
        raise RequestError(None, f"the body must be a JSON object, got {type(body).__name__}")
    params: dict[str, Any] = {"kind": "image", "prompt": _text(body, "prompt", True)}
    params["width"], params["height"] = _size(body, folder)
    params["n"] = _int(body, "n", 1, LIMITS["n"]) or 1
    params["num_inference_steps"] = _int(body, "num_inference_steps", 1, LIMITS["num_inference_steps"])
    params["guidance_scale"] = _float(body, "guidance_scale")
    params["negative_prompt"] = _text(body, "negative_prompt", False)
    params["true_cfg_scale"] = _float(body, "true_cfg_scale")
    if cfg_parallel and not ((params["true_cfg_scale"] or 0) > 1 and params["negative_prompt"]):
        raise RequestError("true_cfg_scale", _CFG_OFF + f"{folder.class_name} guides so only with true_cfg_scale "
                           "above 1 and a negative_prompt")
    params["seed"] = _seed(body)
    fmt = body.get("response_format")
    if fmt not in (None, "b64_json"):
        raise RequestError("response_format", f"response_format must be 'b64_json' (this server keeps no image "
                           f"URLs), got {fmt!r}")
    params["cache"] = _extra(body, caches)
    return params
