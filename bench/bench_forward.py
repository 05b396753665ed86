"""Figures 2 and 3: a sharded forward vs an unsharded one, prefetch on vs off, and a
denoising loop with the weights resident vs resharded every step.

Every rank runs, interleaved repetition by repetition and on the same inputs:
  * unsharded: the reference model with the bf16-rounded weights every rank holds whole;
  * sharded, prefetch on (depth 1) and prefetch off (depth 0), param_dtype bfloat16;
  * a short denoising loop: per-step resharding (prefetch on) vs ``hsdp.resident``.
All outputs are checked equal before anything is timed.

    .venv/bin/python bench/bench_forward.py [--preset base] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import sys


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="base")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--size", type=int, default=32, help="latent height = width")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="denoising steps per loop (figure 3)")
    p.add_argument("--rank", action="store_true")
    return p.parse_args(argv)


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np

    import hsdp
    from hsdp import models
    from harness import interleaved

    world = hsdp.distributed.init_process_group()
    cfg = models.DiTConfig.preset(args.preset)
    x, t, ctx = models.make_inputs(cfg, frames=args.frames, height=args.size, width=args.size, seed=1)

    ref = models.make_model(args.preset, seed=0)
    for p in ref.parameters():
        p.data = hsdp._C.round_to(p.data, "bfloat16")

    def sharded(depth: int):
        m = models.make_model(args.preset, seed=0)
        hsdp.apply_hsdp_to_model(m, hsdp.HSDPInferenceConfig(enabled=True, prefetch_depth=depth))
        return m

    on, off = sharded(1), sharded(0)
    expect = ref(x, t, ctx)
    for m in (on, off):  # records the order, sizes the pool, and checks exactness
        assert np.array_equal(m(x, t, ctx), expect)
    fns = [lambda: ref(x, t, ctx), lambda: on(x, t, ctx), lambda: off(x, t, ctx)]
    t_ref, t_on, t_off = interleaved(fns, args.reps, sync=world.barrier)

    def loop(model, resident: bool) -> None:
        lat = x
        ts = np.linspace(1.0, 0.0, args.steps + 1, dtype=np.float32)

        def steps() -> None:
            nonlocal lat
            for i in range(args.steps):
                v = model(lat, np.full(x.shape[0], ts[i] * 1000, np.float32), ctx)
                lat = lat + (ts[i + 1] - ts[i]) * v

        if resident:
            with hsdp.resident(model):
                steps()
        else:
            steps()

    t_step, t_res = interleaved([lambda: loop(on, False), lambda: loop(on, True)], max(2, args.reps // 2),
                                sync=world.barrier)
    stats = hsdp.memory_stats()
    if world.rank == 0:
        print("RESULT " + json.dumps({
            "ranks": world.size, "preset": args.preset, "tokens": int(np.prod(x.shape[2:])) // 4,
            "unsharded_s": t_ref, "prefetch_on_s": t_on, "prefetch_off_s": t_off,
            "loop_reshard_s": t_step, "loop_resident_s": t_res, "steps": args.steps,
            "prefetches": on._hsdp_context.schedule.prefetches, "buffer_allocs": stats["buffer_allocs"],
        }))


def main(args: argparse.Namespace) -> None:
    from harness import launch, machine, table

    extra = ["--preset", args.preset, "--frames", str(args.frames), "--size", str(args.size),
             "--reps", str(args.reps), "--steps", str(args.steps)]
    line = next(l for l in launch(args.ranks, "bench/bench_forward.py", "--rank", *extra).splitlines()
                if l.startswith("RESULT "))
    r = json.loads(line[7:])
    print(f"Forward of the '{r['preset']}' preset, {r['tokens']} tokens, {r['ranks']} ranks ({machine()}); "
          f"median seconds")
    print(table(["path", "s / forward", "vs unsharded"], [
        ["unsharded (bf16-rounded weights, whole on every rank)", f"{r['unsharded_s']:.3f}", "1.000"],
        ["sharded, prefetch on (depth 1)", f"{r['prefetch_on_s']:.3f}", f"{r['prefetch_on_s'] / r['unsharded_s']:.3f}"],
        ["sharded, prefetch off", f"{r['prefetch_off_s']:.3f}", f"{r['prefetch_off_s'] / r['unsharded_s']:.3f}"],
    ]))
    print(f"prefetch off / on: {r['prefetch_off_s'] / r['prefetch_on_s']:.3f}")
    print()
    print(f"Denoising loop of {r['steps']} steps, same model ({r['ranks']} ranks); median seconds per step")
    ps, pr = r["loop_reshard_s"] / r["steps"], r["loop_resident_s"] / r["steps"]
    print(table(["path", "s / step", "ratio"], [
        ["reshard after every forward (prefetch on)", f"{ps:.3f}", f"{ps / pr:.3f}"],
        ["hsdp.resident for the loop", f"{pr:.3f}", "1.000"],
    ]))


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    a = parse(sys.argv[1:])
    rank_main(a) if a.rank else main(a)
