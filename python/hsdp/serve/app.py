"""The HTTP routes (FastAPI), on rank 0: vllm-omni's Videos API, OpenAI's images API, health,
models and Prometheus metrics. The routes check requests and read the job store; they never
touch the model (the job loop in :mod:`.worker` does, on every rank). Imported by rank 0
alone, when it serves.

Every error, the framework's own 404 and 405 included, is OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``. A body that is too large is a 413, a
content type the route does not read a 415."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from hsdp.cli.folder import PipelineFolder

from .jobs import COMPLETED, Job, JobStore, QueueFull, Stopping
from .params import (
    LIMITS,
    Limits,
    RequestError,
    folder_options,
    image_params,
    video_params,
)

__all__ = ["MAX_BODY_BYTES", "create_app"]

# The largest body read: an input_reference image at its limit, and the form around it.
MAX_BODY_BYTES = LIMITS["input_reference_bytes"] + (1 << 20)
_FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error"}


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> Any:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def create_app(store: JobStore, folder: PipelineFolder, model_id: str, ready: threading.Event,
               api_key: str | None = None, cfg_parallel: bool = False, caches: tuple[str, ...] = (),
               limits: Limits | None = None, metrics: Any = None) -> Any:
    """The FastAPI application serving ``store``'s jobs for the pipeline in ``folder``
    (``cfg_parallel``: the ranks split classifier-free guidance, so every job must guide;
    ``limits``: what one request may ask; ``metrics``: a :class:`~hsdp.serve.metrics.ServeMetrics`
    for ``GET /metrics``, which the API key guards like every route but /health)."""
    app = FastAPI(title="hsdp serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    limits = limits or Limits()
    options = folder_options(folder)
    # A text field larger than this is refused while it is read (413); below it, the prompt
    # limit answers (400 naming --max-prompt-chars). UTF-8: up to 4 bytes a character.
    max_part = max(1 << 16, 4 * limits.max_prompt_chars + 1024)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Any:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} (see docs/serving.md for the API)"
        elif exc.status_code == 405:
            allowed = exc.headers.get("Allow", "") if exc.headers else ""
            message = f"{request.method} is not allowed on {request.url.path}" + (f"; allowed: {allowed}" if allowed else "")
        else:
            message = str(exc.detail)
        response = _error(exc.status_code, message, _TYPES.get(exc.status_code, "invalid_request_error"))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Any:
        return _error(400, f"invalid request: {exc.errors()[:3]}")

    @app.middleware("http")
    async def require_key(request: Request, call_next: Any) -> Any:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return _error(413, f"the body is {int(length)} bytes; at most {MAX_BODY_BYTES} are taken")
        if api_key is not None and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
                return _error(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                              "authentication_error")
        return await call_next(request)

    def submit(params: dict[str, Any]) -> Job:
        if not store.accepting:
            raise Stopping("the server is shutting down and takes no new jobs")
        return store.submit(params)

    async def wait(job: Job) -> None:
        await anyio.to_thread.run_sync(job.done.wait)

    def bad(exc: RequestError) -> Any:
        return _error(exc.status, str(exc), "not_found_error" if exc.status == 404 else "invalid_request_error",
                      exc.param)

    def check_model(fields: Any) -> None:
        model = fields.get("model")
        if model not in (None, "", model_id):
            raise RequestError("model", f"model {model!r} is not served here; this server serves {model_id!r}", 404)

    def content_type(request: Request) -> str:
        return request.headers.get("content-type", "").split(";")[0].strip().lower()

    async def json_body(request: Request) -> Any:
        try:
            return await request.json()
        except Exception:  # noqa: BLE001 - the client's error, named
            raise RequestError(None, "the body is not valid JSON (Content-Type: application/json)") from None

    async def video_request(request: Request) -> dict[str, Any]:
        kind = content_type(request)
        image: bytes | None = None
        if kind == "application/json":
            body = await json_body(request)
            if not isinstance(body, dict):
                raise RequestError(None, f"the body must be a JSON object, got {type(body).__name__}")
            fields: dict[str, Any] = body
        elif kind in _FORMS or kind == "":
            try:
                form = await request.form(max_part_size=max_part)
            except HTTPException as exc:  # Starlette's words for an oversized or malformed part
                status = 413 if "maximum size" in str(exc.detail) else 400
                raise RequestError(None, f"the form could not be read: {exc.detail} (a text field takes at most "
                                   f"{max_part} bytes)", status) from None
            except Exception as exc:  # noqa: BLE001 - any unreadable body is the client's error
                raise RequestError(None, f"the form could not be read ({exc})") from None
            fields = {}
            for key, value in form.multi_items():
                if hasattr(value, "read"):  # an uploaded file
                    if key != "input_reference":
                        raise RequestError(key, f"{key} must be a text field; only input_reference is a file")
                    image = await value.read(LIMITS["input_reference_bytes"] + 1)
                else:
                    fields[key] = value
        else:
            raise RequestError(None, f"Content-Type {kind!r} is not read here: send multipart/form-data, "
                               "application/x-www-form-urlencoded or application/json", 415)
        check_model(fields)
        return video_params(fields, image, folder, cfg_parallel, caches, limits, options)

    @app.get("/health")
    async def health() -> Any:
        status = "ok" if ready.is_set() and store.accepting else ("stopping" if ready.is_set() else "loading")
        return JSONResponse({"status": status, "model": model_id, "queue_length": store.queue_length()},
                            200 if status == "ok" else 503)

    REFUSED = (RequestError, Stopping, QueueFull)

    def refusal(exc: Exception) -> Any:
        """The answer to a job not accepted: the request's fault (4xx naming the field), a
        server that is stopping (503) or a full queue (429)."""
        if isinstance(exc, RequestError):
            return bad(exc)
        if isinstance(exc, Stopping):
            return _error(503, str(exc), "service_unavailable")
        return _error(429, str(exc), "rate_limit_exceeded")

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "hsdp", "root": str(folder.path),
                                            "pipeline": folder.class_name, "output": folder.output}]}

    @app.post("/v1/videos")
    async def create_video(request: Request) -> Any:
        try:
            job = submit(await video_request(request))
        except REFUSED as exc:
            return refusal(exc)
        return job.public()

    @app.post("/v1/videos/sync")
    async def create_video_sync(request: Request) -> Any:
        try:
            job = submit(await video_request(request))
        except REFUSED as exc:
            return refusal(exc)
        await wait(job)
        if job.status != COMPLETED or job.output is None:
            return _error(500, f"job {job.id} failed: {job.error}", "generation_failed")
        return Response(job.output.read_bytes(), media_type="video/mp4",
                        headers={"X-Video-Id": job.id, "X-Seed": str(job.params["seed"])})

    @app.get("/v1/videos")
    async def list_videos() -> Any:
        return {"object": "list", "data": [j.public(listed=True) for j in store.list("video")]}

    @app.get("/v1/videos/{job_id}")
    async def get_video(job_id: str) -> Any:
        job = store.get(job_id)
        if job is None:
            return _error(404, f"no video job {job_id!r}", "not_found_error", "video_id")
        return job.public()

    @app.get("/v1/videos/{job_id}/content")
    async def video_content(job_id: str) -> Any:
        job = store.get(job_id)
        if job is None:
            return _error(404, f"no video job {job_id!r}", "not_found_error", "video_id")
        if job.status != COMPLETED or job.output is None:
            detail = f"failed: {job.error}" if job.error else f"is {job.status}"
            return _error(409, f"video job {job_id} {detail}; its content exists once it is completed",
                          "invalid_request_error", "video_id")
        return FileResponse(job.output, media_type="video/mp4", filename=f"{job_id}.mp4")

    @app.delete("/v1/videos/{job_id}")
    async def delete_video(job_id: str) -> Any:
        """A queued or finished job: removed. A running one: asked to stop at its next step
        (202; it ends ``cancelled`` and stays listed, deletable then)."""
        job, deleted = store.delete(job_id)
        if job is None:
            return _error(404, f"no video job {job_id!r}", "not_found_error", "video_id")
        if not deleted:
            return JSONResponse({"id": job_id, "object": "video.deleted", "deleted": False, "status": "cancelling"},
                                202)
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    @app.get("/metrics")
    async def prometheus() -> Any:
        if metrics is None:
            return _error(404, "this server keeps no metrics", "not_found_error")
        data, media = metrics.render()
        return Response(data, media_type=media)

    @app.post("/v1/images/generations")
    async def create_images(request: Request) -> Any:
        try:
            if content_type(request) not in ("application/json", ""):
                raise RequestError(None, f"Content-Type {content_type(request)!r} is not read here: send "
                                   "application/json", 415)
            body = await json_body(request)
            if isinstance(body, dict):
                check_model(body)
            job = submit(image_params(body, folder, cfg_parallel, caches, limits))
        except REFUSED as exc:
            return refusal(exc)
        await wait(job)
        if job.status != COMPLETED or job.images is None:
            return _error(500, f"job {job.id} failed: {job.error}", "generation_failed")
        return {"created": int(job.created_at), "seed": job.params["seed"],
                "data": [{"b64_json": b} for b in job.images]}

    return app
