"""The HTTP routes (FastAPI), on rank 0: vllm-omni's Videos API, OpenAI's images API, health
and models. The routes check requests and read the job store; they never touch the model (the
job loop in :mod:`.worker` does, on every rank). Imported by rank 0 alone, when it serves."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from hsdp.cli.folder import PipelineFolder

from .jobs import COMPLETED, Conflict, Job, JobStore, QueueFull, Stopping
from .params import RequestError, image_params, video_params

__all__ = ["create_app"]


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> Any:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def create_app(store: JobStore, folder: PipelineFolder, model_id: str, ready: threading.Event,
               api_key: str | None = None, cfg_parallel: bool = False, caches: tuple[str, ...] = ()) -> Any:
    """The FastAPI application serving ``store``'s jobs for the pipeline in ``folder``
    (``cfg_parallel``: the ranks split classifier-free guidance, so every job must guide)."""
    app = FastAPI(title="hsdp serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.middleware("http")
    async def require_key(request: Request, call_next: Any) -> Any:
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

    async def video_request(request: Request) -> dict[str, Any]:
        try:
            form = await request.form()
        except Exception as exc:  # noqa: BLE001 - any unreadable body is the client's error
            raise RequestError(None, f"the body must be a multipart or urlencoded form ({exc})") from None
        fields: dict[str, Any] = {}
        image: bytes | None = None
        for key, value in form.multi_items():
            if hasattr(value, "read"):  # an uploaded file
                if key != "input_reference":
                    raise RequestError(key, f"{key} must be a text field; only input_reference is a file")
                image = await value.read()
            else:
                fields[key] = value
        check_model(fields)
        return video_params(fields, image, folder, cfg_parallel, caches)

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
        return {"object": "list", "data": [j.public() for j in store.list("video")]}

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
        try:
            job = store.delete(job_id)
        except Conflict as exc:
            return _error(409, str(exc), "invalid_request_error", "video_id")
        if job is None:
            return _error(404, f"no video job {job_id!r}", "not_found_error", "video_id")
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    @app.post("/v1/images/generations")
    async def create_images(request: Request) -> Any:
        try:
            try:
                body = await request.json()
            except Exception:  # noqa: BLE001 - the client's error, named
                raise RequestError(None, "the body must be a JSON object (Content-Type: application/json)") from None
            if isinstance(body, dict):
                check_model(body)
            job = submit(image_params(body, folder, cfg_parallel, caches))
        except REFUSED as exc:
            return refusal(exc)
        await wait(job)
        if job.status != COMPLETED or job.images is None:
            return _error(500, f"job {job.id} failed: {job.error}", "generation_failed")
        return {"created": int(job.created_at), "seed": job.params["seed"],
                "data": [{"b64_json": b} for b in job.images]}

    return app
