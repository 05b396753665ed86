"""``hsdp serve``: one sharded diffusers pipeline behind vllm-omni's Videos HTTP API (and
OpenAI's images API for image models).

Rank 0 runs the HTTP server (FastAPI on uvicorn, in a thread) and the job loop (its main
thread); every rank runs the same pipeline call for each job, one job at a time, in arrival
order. Rank 0 broadcasts each job's parameters over the world group; the other ranks wait for
the next message. See docs/serving.md.

Modules: :mod:`.cli` (flags, starting the ranks, shutdown), :mod:`.params` (request checks,
no torch), :mod:`.jobs` (the queue and the job store), :mod:`.protocol` (messages between
ranks), :mod:`.worker` (the pipeline call on every rank), :mod:`.app` (the routes).
Nothing here imports torch or diffusers at module level; :mod:`.app` alone imports FastAPI.
"""
