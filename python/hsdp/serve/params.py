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
from dataclasses import dataclass
from typing import Any

from hsdp.cli.folder import PipelineFolder

__all__ = ["LIMITS", "LISTED_PROMPT_CHARS", "Limits", "RequestError", "fill_defaults", "folder_options", "image_params",
           "video_params"]

# Upper bounds a request may ask for: beyond them a job would hold the server for hours.
LIMITS = {"width": 4096, "height": 4096, "num_frames": 1025, "num_inference_steps": 1000, "fps": 240, "n": 8,
          "input_reference_bytes": 32 << 20}
DEFAULT_FPS = 16
SEED_MAX = 2**63 - 1
# How much of a prompt a job listing shows: the whole prompt is in GET /v1/videos/{id}.
LISTED_PROMPT_CHARS = 200


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, set at start (``--max-pixels`` ...): over one is a 400
    naming the flag; a request that leaves a size out gets the model's default capped by
    them. None: only the hard bounds of :data:`LIMITS`."""

    max_pixels: int | None = None  # width x height
    max_frames: int | None = None
    max_steps: int | None = None
    max_prompt_chars: int = 10000  # a prompt longer than this is a 400 (Wan's encoder reads 512 tokens)

    def check(self, params: dict[str, Any]) -> None:
        for name in ("prompt", "negative_prompt"):
            text = params.get(name)
            if text is not None and len(text) > self.max_prompt_chars:
                raise RequestError(name, f"{name} has {len(text)} characters; this server takes at most "
                                   f"{self.max_prompt_chars} (--max-prompt-chars)")
        w, h = params.get("width"), params.get("height")
        if self.max_pixels is not None and w is not None and h is not None and w * h > self.max_pixels:
            raise RequestError("size", f"size {w}x{h} is {w * h} pixels; this server takes at most {self.max_pixels} "
                               "(--max-pixels)")
        n = params.get("num_frames")
        if self.max_frames is not None and n is not None and n > self.max_frames:
            param = "seconds" if params.get("frames_from_seconds") else "num_frames"
            raise RequestError(param, f"num_frames {n} is over this server's limit of {self.max_frames} (--max-frames)")
        steps = params.get("num_inference_steps")
        if self.max_steps is not None and steps is not None and steps > self.max_steps:
            raise RequestError("num_inference_steps", f"num_inference_steps {steps} is over this server's limit of "
                               f"{self.max_steps} (--max-steps)")


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


def _float(fields: Mapping[str, Any], name: str, low: float = 0.0, high: float | None = None) -> float | None:
    """A positive finite number (above ``low``; at most ``high``), or None when absent."""
    value = fields.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise RequestError(name, f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RequestError(name, f"{name} must be a number, got {value!r}") from None
    if not (math.isfinite(number) and number > low):
        raise RequestError(name, f"{name} must be a positive finite number, got {value!r}")
    if high is not None and number > high:
        raise RequestError(name, f"{name} must be <= {high:g}, got {value!r}")
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


def _frames(fields: Mapping[str, Any], fps: int, folder: PipelineFolder, params: dict[str, Any]) -> int | None:
    """``num_frames``, or OpenAI's ``seconds`` x ``fps`` rounded to the nearest count the model
    takes (Wan's VAE: 4k + 1), the rounding kept in ``params["frames_from_seconds"]``."""
    t = folder.temporal_factor
    n = _int(fields, "num_frames", 1, LIMITS["num_frames"])
    seconds = _float(fields, "seconds")
    if seconds is not None:
        if n is not None:
            raise RequestError("seconds", "give either seconds or num_frames, not both")
        raw = seconds * fps
        n = max(0, round((raw - 1) / t)) * t + 1 if t else max(1, round(raw))
        if n > LIMITS["num_frames"]:
            raise RequestError("seconds", f"seconds {seconds:g} at fps {fps} is {raw:g} frames; at most "
                               f"{LIMITS['num_frames']} are taken")
        rule = f"{folder.class_name} takes {t}k+1 frames" if t else "whole frames"
        params["frames_from_seconds"] = {"seconds": seconds, "fps": fps, "frames": raw, "num_frames": n,
                                         "note": f"{seconds:g} s x {fps} fps = {raw:g} frames, rounded to {n} ({rule})"}
        return n
    if n is not None and t and (n - 1) % t:
        raise RequestError("num_frames", f"num_frames {n}: {folder.class_name}'s VAE needs num_frames - 1 to be a "
                           f"multiple of {t} (e.g. {(n - 1) // t * t + 1} or {((n - 1) // t + 1) * t + 1})")
    return n


def _reference(value: Any) -> bytes:
    """``input_reference`` in a JSON body: base64 text, a data: URL, or OpenAI's object
    ``{"image_url": "data:..."}`` (this server fetches no URLs)."""
    if isinstance(value, dict):
        value = value.get("image_url")
    if not isinstance(value, str) or not value:
        raise RequestError("input_reference", "input_reference in a JSON body must be base64 image bytes, a data: URL "
                           "or {\"image_url\": \"data:...\"}; or send it as a multipart file")
    if value.startswith(("http://", "https://")):
        raise RequestError("input_reference", "input_reference URLs are not fetched by this server: send the image "
                           "as a multipart file or a data: URL")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:
        return base64.b64decode(value, validate=True)
    except (ValueError, TypeError):
        raise RequestError("input_reference", "input_reference is not valid base64") from None


def video_params(fields: Mapping[str, Any], image: bytes | None, folder: PipelineFolder,
                 cfg_parallel: bool = False, caches: tuple[str, ...] = (), limits: Limits | None = None,
                 options: tuple[str, ...] = ()) -> dict[str, Any]:
    """A ``POST /v1/videos`` body (a form's text fields and the ``input_reference`` file's
    bytes, or a JSON object). ``options``: which of ``flow_shift``/``boundary_ratio`` this
    pipeline can change per job (:func:`folder_options`)."""
    if folder.output != "video":
        raise RequestError(None, f"{folder.class_name} makes images, not videos: use POST /v1/images/generations", 404)
    params: dict[str, Any] = {"kind": "video", "prompt": _text(fields, "prompt", True)}
    params["negative_prompt"] = _text(fields, "negative_prompt", False)
    params["width"], params["height"] = _size(fields, folder)
    params["fps"] = _int(fields, "fps", 1, LIMITS["fps"]) or DEFAULT_FPS
    params["num_frames"] = _frames(fields, params["fps"], folder, params)
    params["num_inference_steps"] = _int(fields, "num_inference_steps", 1, LIMITS["num_inference_steps"])
    params["guidance_scale"] = _float(fields, "guidance_scale")
    if cfg_parallel and params["guidance_scale"] is not None and params["guidance_scale"] <= 1.0:
        raise RequestError("guidance_scale", _CFG_OFF + f"guidance_scale {params['guidance_scale']:g} turns it off; "
                           "use a scale above 1")
    params["guidance_scale_2"] = _float(fields, "guidance_scale_2")
    params["boundary_ratio"] = _float(fields, "boundary_ratio", 0.0, 1.0)
    params["flow_shift"] = _float(fields, "flow_shift")
    for name in ("boundary_ratio", "flow_shift", "guidance_scale_2"):
        if params[name] is not None and name not in options:
            raise RequestError(name, f"{name} does not apply to {folder.class_name} (it applies to "
                               f"{'two-expert Wan2.2 folders' if name != 'flow_shift' else 'schedulers with a flow_shift'})")
    params["seed"] = _seed(fields)
    if image is None and fields.get("input_reference") not in (None, ""):
        image = _reference(fields["input_reference"])
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
    (limits or Limits()).check(params)
    return params


def folder_options(folder: PipelineFolder) -> tuple[str, ...]:
    """The per-job options this folder's pipeline has: ``boundary_ratio`` and
    ``guidance_scale_2`` (Wan2.2's two experts: model_index.json lists transformer_2),
    ``flow_shift`` (its scheduler's config has one)."""
    import json

    out: list[str] = []
    try:
        index = json.loads((folder.path / "model_index.json").read_text())
        if isinstance(index.get("transformer_2"), list) and index["transformer_2"][0] is not None:
            out += ["boundary_ratio", "guidance_scale_2"]
        sched = json.loads((folder.path / "scheduler" / "scheduler_config.json").read_text())
        if "flow_shift" in sched:
            out.append("flow_shift")
    except (OSError, ValueError, AttributeError):
        pass
    return tuple(out)


def _cap_size(width: int, height: int, max_pixels: int, m: int) -> tuple[int, int]:
    """(width, height) scaled down, aspect kept, to at most ``max_pixels``, multiples of ``m``."""
    scale = math.sqrt(max_pixels / (width * height))
    w, h = max(m, int(width * scale) // m * m), max(m, int(height * scale) // m * m)
    while w * h > max_pixels and (w > m or h > m):
        if w >= h:
            w -= m
        else:
            h -= m
    return w, h


def fill_defaults(params: dict[str, Any], defaults: Mapping[str, Any], limits: Limits,
                  folder: PipelineFolder) -> dict[str, Any]:
    """The job's parameters with every size it left out set to the pipeline's default
    (``defaults``: its call's, from :func:`hsdp.serve.worker.pipeline_defaults`) capped by the
    limits, so the job shows what it ran with; ``params["defaulted"]`` says which were filled
    and how they were capped."""
    out = dict(params)
    notes: dict[str, str] = {}
    m, t = folder.spatial_multiple, folder.temporal_factor
    if out.get("width") is None or out.get("height") is None:
        w = out.get("width") or defaults.get("width")
        h = out.get("height") or defaults.get("height")
        if w and h:
            w, h = int(w) // m * m or m, int(h) // m * m or m
            note = "the model's default"
            if limits.max_pixels is not None and w * h > limits.max_pixels:
                w0, h0 = w, h
                w, h = _cap_size(w, h, limits.max_pixels, m)
                note = f"the model's default {w0}x{h0} capped by --max-pixels {limits.max_pixels}"
            out["width"], out["height"] = w, h
            notes["size"] = note
    if out["kind"] == "video" and out.get("num_frames") is None and defaults.get("num_frames"):
        n, note = int(defaults["num_frames"]), "the model's default"
        if limits.max_frames is not None and n > limits.max_frames:
            n = (limits.max_frames - 1) // t * t + 1 if t else limits.max_frames
            note = f"the model's default {defaults['num_frames']} capped by --max-frames {limits.max_frames}"
        out["num_frames"] = n
        notes["num_frames"] = note
    if out.get("num_inference_steps") is None and defaults.get("num_inference_steps"):
        n, note = int(defaults["num_inference_steps"]), "the model's default"
        if limits.max_steps is not None and n > limits.max_steps:
            n, note = limits.max_steps, f"the model's default {n} capped by --max-steps {limits.max_steps}"
        out["num_inference_steps"] = n
        notes["num_inference_steps"] = note
    if notes:
        out["defaulted"] = notes
    return out


def image_params(body: Any, folder: PipelineFolder, cfg_parallel: bool = False,
                 caches: tuple[str, ...] = (), limits: Limits | None = None) -> dict[str, Any]:
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
    (limits or Limits()).check(params)
    return params
