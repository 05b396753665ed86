"""One rank of the torch.compile checks (started by tests/test_compile.py under mpiexec, 2 ranks).

`python tests/compile_worker.py CASE...`, a CASE being

- `KIND:LAYOUT[:BACKEND]` (KIND wan or flux; LAYOUT hsdp: HSDP 1x2, ulysses: HSDP and Ulysses 2 over
  the same ranks, ring: HSDP and ring 2): a stock diffusers model sharded in float32,
  compiled both ways: `torch.compile(model)` and `model.compile_repeated_blocks()`, each on
  a model of its own whose first forward is the compiled one (the warm-up: it also records
  the prefetch order). Every output equals the eager sharded model's (max abs <= 1e-5).
  After the warm-up, forwards run under `torch._dynamo.config.error_on_recompile`, across
  resharding: an explicit `hsdp.unshard` / `hsdp.reshard` of every unit and `hsdp.resident`.
- `wan:residency`: Wan with a residency budget that keeps some units gathered: the budget
  chooses them at the end of the (compiled) warm-up forward, so every later forward runs
  with the units it kept, no recompile.
- `wan:wire`: a bfloat16 Wan with the float8 wire, compiled whole, against the same model
  eager (relative L2 <= 1e-2: the compiled kernels round bfloat16 their own way), no recompile.
- `pipeline:DIR`: the tiny Wan 2.2 folder DIR loaded over HSDP 1x2 in float32, both experts
  compiled whole by hsdp.cli.compile_mode.compile_pipeline, against the same pipeline eager;
  the second request runs under error_on_recompile (both experts again).
- `pipeline-cfg:DIR`: the same with CFG parallel (cfg_parallel_size=2, guidance on: each rank
  runs one of a step's two transformer calls, so each rank's forwards are half the HSDP case's).
- `pipeline-dp:DIR`: the same with two data-parallel lanes of one rank (data_parallel_size=2),
  two prompts a request, one a lane (the lanes' ballot counted).

Each case resets Dynamo first (models of one class share code objects, so a new model's first
compile would count as a recompile of the last one's frames) and requires that something was
compiled (graphs counted), so a silent fallback to eager fails. The backend is a case's third
field, else aot_eager (Dynamo and AOTAutograd, where hsdp's parameters meet the graphs,
without Inductor's C++ builds: a cold Inductor cache costs a minute a model on this machine).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import hsdp
from hsdp import parallel
from hsdp.engine.config import DiffusionParallelConfig
from hsdp.parallel.context import apply_sequence_parallel_torch
from torch_models import MODELS, run

torch.set_num_threads(1)
BACKEND = "aot_eager"
TOL = 1e-5


def close(got: torch.Tensor, expect: torch.Tensor, what: str, tol: float = TOL) -> float:
    diff = (got.float() - expect.float()).abs().max().item()
    if got.shape != expect.shape or not diff <= tol:
        raise AssertionError(f"rank {hsdp.distributed.get_rank()}: {what}: max abs {diff:.3g} (shape "
                             f"{tuple(got.shape)} vs {tuple(expect.shape)}), over {tol:g}")
    return diff


@contextlib.contextmanager
def no_recompile() -> Iterator[None]:
    torch._dynamo.config.error_on_recompile = True
    try:
        yield
    finally:
        torch._dynamo.config.error_on_recompile = False


def fresh() -> None:
    torch._dynamo.reset()
    counters.clear()


def compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def build(kind: str, layout: str, world: Any, **config: Any) -> torch.nn.Module:
    make, _, cond = MODELS[kind]
    model = make(0)
    model._hsdp_shard_conditions = [cond]
    config.setdefault("param_dtype", "float32")
    hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, hsdp_shard_size=world.size, **config))
    if layout != "hsdp":
        dp = DiffusionParallelConfig(use_hsdp=True, **{"ulysses_degree" if layout == "ulysses" else "ring_degree":
                                                         world.size})
        apply_sequence_parallel_torch(model, parallel.init_parallel_groups(dp, world).sp)
    return model


def check_model(kind: str, layout: str, world: Any, backend: str = BACKEND) -> None:
    expect = run(build(kind, layout, world), kind)
    for how in ("whole", "regional"):
        fresh()
        model = build(kind, layout, world)
        if how == "whole":
            target = torch.compile(model, backend=backend)
        else:
            model.compile_repeated_blocks(backend=backend)
            target = model

        def call(target: torch.nn.Module = target) -> torch.Tensor:
            return run(target, kind)

        what = f"{kind} {layout} {how} ({backend})"
        diff = close(call(), expect, f"{what}, warm-up")
        graphs = compiled_graphs()
        assert graphs > 0, f"{what}: nothing was compiled"
        with no_recompile():
            for i in range(2):
                diff = max(diff, close(call(), expect, f"{what}, forward {i + 2}"))
            hsdp.unshard(model, recurse=True)  # every unit gathered and kept: the views stay bound
            diff = max(diff, close(call(), expect, f"{what}, unsharded"))
            hsdp.reshard(model, recurse=True)
            diff = max(diff, close(call(), expect, f"{what}, resharded"))
            with hsdp.resident(model):
                diff = max(diff, close(call(), expect, f"{what}, resident"))
            diff = max(diff, close(call(), expect, f"{what}, after resident"))
        assert compiled_graphs() == graphs, f"{what}: compiled again in steady state"
        print(f"rank {world.rank}: compile {what} ok, {graphs} graphs, max abs {diff:.3g}", flush=True)


def check_residency(world: Any) -> None:
    expect = run(build("wan", "hsdp", world), "wan")
    fresh()
    model = build("wan", "hsdp", world, resident_bytes=48 * 1024)  # the root and a block or two of 3
    cm = torch.compile(model, backend=BACKEND)
    close(run(cm, "wan"), expect, "wan residency, warm-up")
    stats = hsdp.residency_stats(model)
    kept = stats["resident_units"]
    assert kept and len(kept) < len(hsdp.get_units(model)), stats
    with no_recompile():
        for i in range(3):
            close(run(cm, "wan"), expect, f"wan residency, forward {i + 2}")
    held = [u.label for u in hsdp.get_units(model) if u.unit.is_unsharded]
    assert set(kept) <= set(held), (kept, held)  # the kept units stayed gathered across forwards
    print(f"rank {world.rank}: compile wan residency ok, kept {kept}", flush=True)


def check_wire(world: Any) -> None:
    args, kwargs = MODELS["wan"][1]()

    def wired() -> torch.nn.Module:
        return build("wan", "hsdp", world, param_dtype="bfloat16", wire_dtype="float8_e4m3fn")

    with torch.inference_mode():
        expect = wired()(*args, **kwargs)[0].float()
    fresh()
    model = wired()
    assert all(st.unit.is_encoded for st in hsdp.get_units(model))
    cm = torch.compile(model, backend=BACKEND)

    def rel() -> float:
        with torch.inference_mode():
            got = cm(*args, **kwargs)[0].float()
        return ((got - expect).norm() / expect.norm()).item()

    errors = [rel()]
    assert compiled_graphs() > 0, "wan wire: nothing was compiled"
    with no_recompile():
        errors += [rel() for _ in range(2)]
    assert max(errors) <= 1e-2, errors
    print(f"rank {world.rank}: compile wan wire ok, relative L2 {max(errors):.3g}", flush=True)


STEPS = 4  # per request; guidance on, so 2 transformer calls a step


def check_pipeline(folder: str, world: Any, layout: str = "hsdp") -> None:
    import numpy as np

    import hsdp.pipelines as hp
    from hsdp.cli.compile_mode import compile_pipeline

    prompts = ["a cat running in the snow", "a red boat on a lake"][: 2 if layout == "dp" else 1]
    call = {"prompt": prompts, "negative_prompt": ["blurry"] * len(prompts), "height": 32, "width": 32,
            "num_frames": 5, "num_inference_steps": STEPS, "guidance_scale": 4.0, "max_sequence_length": 16,
            "output_type": "np"}
    config = DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=world.size,
                                     cfg_parallel_size=2 if layout == "cfg" else 1,
                                     data_parallel_size=2 if layout == "dp" else 1)

    def generate(pipe: Any) -> Any:
        out = hp.generate(pipe, **call, generator=[torch.Generator().manual_seed(i) for i in range(len(prompts))])
        return None if out is None else out.frames

    expect = generate(hp.load_pipeline(folder, config, torch_dtype=torch.float32, progress=False))
    fresh()
    pipe = hp.load_pipeline(folder, config, torch_dtype=torch.float32, progress=False)
    ran = {"transformer": 0, "transformer_2": 0}
    for name in ran:
        getattr(pipe, name).register_forward_pre_hook(lambda *a, n=name: ran.__setitem__(n, ran[n] + 1))
    assert compile_pipeline(pipe, "whole", backend=BACKEND) == ["transformer", "transformer_2"]
    outs = [generate(pipe)]
    graphs = compiled_graphs()
    assert graphs > 0 and all(ran.values()), (graphs, ran)  # both experts ran, compiled
    with no_recompile():
        outs.append(generate(pipe))
    assert compiled_graphs() == graphs
    # this rank's forwards over the two requests: CFG parallel halves them (one call of a
    # step's two), a lane runs its own prompt's
    calls = 2 * STEPS * (1 if layout == "cfg" else 2)
    assert sum(ran.values()) == calls, (layout, ran, calls)
    if layout == "dp":
        ls = hp.pipeline_state(pipe).lockstep
        assert ls is not None and ls.ballots > 0, ls
    if world.rank == 0:
        for i, got in enumerate(outs):
            diff = float(np.abs(got - expect).max())
            assert got.shape == expect.shape and got.shape[0] == len(prompts) and diff <= TOL, (i, got.shape, diff)
    print(f"rank {world.rank}: compile pipeline {layout} ok, {graphs} graphs, forwards {ran}", flush=True)


def main() -> None:
    world = hsdp.distributed.init_process_group()
    assert world.size == 2, world.size
    for case in sys.argv[1:]:
        kind, _, rest = case.partition(":")
        if kind.startswith("pipeline"):
            check_pipeline(rest, world, kind.partition("-")[2] or "hsdp")
        elif rest == "residency":
            check_residency(world)
        elif rest == "wire":
            check_wire(world)
        else:
            layout, _, backend = rest.partition(":")
            check_model(kind, layout, world, backend or BACKEND)


if __name__ == "__main__":
    main()
