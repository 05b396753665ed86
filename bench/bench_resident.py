"""Figure: step time against the residency budget (``resident_bytes``), from 0 to the whole
model, with both ends compared to plain sharding (no budget) and to ``hsdp.resident``.

Every rank builds one sharded model per budget (the NumPy DiT, param_dtype bfloat16,
prefetch depth 1), checks that all of them give the same output as the budget-free one,
then times one forward (a denoising step) of each, interleaved repetition by repetition.

    .venv/bin/python bench/bench_resident.py [--preset base] [--ranks 2] [--points 5] [--png PATH]

Prints a markdown table and, with --png, draws the curve with Pillow (matplotlib is not a
dependency).
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
    p.add_argument("--points", type=int, default=5, help="budgets from 0 to the whole model, evenly spaced")
    p.add_argument("--png", default=None, help="where to draw the curve (PNG)")
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

    def sharded(budget):
        m = models.make_model(args.preset, seed=0)
        hsdp.apply_hsdp_to_model(m, hsdp.HSDPInferenceConfig(enabled=True, resident_bytes=budget))
        return m

    plain = sharded(None)
    expect = plain(x, t, ctx)
    whole = sum(u.full_bytes for u in hsdp.get_units(plain))
    budgets = [round(whole * i / (args.points - 1)) for i in range(args.points)]
    budgeted = [sharded(b) for b in budgets]
    for m in budgeted:  # the first forward chooses, the second gathers the kept units once
        for _ in range(2):
            assert np.array_equal(m(x, t, ctx), expect)

    def resident_step() -> None:
        plain(x, t, ctx)

    fns = [lambda: plain(x, t, ctx), *[(lambda m=m: m(x, t, ctx)) for m in budgeted]]
    times = interleaved(fns, args.reps, sync=world.barrier)
    stats = [hsdp.residency_stats(m) for m in budgeted]  # last_forward_gathers: a steady forward's
    with hsdp.resident(plain):  # every unit gathered for the block: no gathers per step
        assert np.array_equal(plain(x, t, ctx), expect)
        (t_res,) = interleaved([resident_step], args.reps, sync=world.barrier)
    if world.rank == 0:
        print("RESULT " + json.dumps({
            "ranks": world.size, "preset": args.preset, "tokens": int(np.prod(x.shape[2:])) // 4,
            "whole_bytes": whole, "sharded_s": times[0], "resident_s": t_res,
            "points": [{"budget": b, "s": s, "resident_bytes": st["resident_bytes"],
                        "resident_units": len(st["resident_units"]), "units": st["units"],
                        "gathers": st["last_forward_gathers"], "bytes_per_gather": st["bytes_per_gather"]}
                       for b, s, st in zip(budgets, times[1:], stats)],
        }))


def draw(r: dict, path: str) -> None:
    """The curve with Pillow: budget (share of the model) against s/step, with the sharded
    and resident levels as horizontal lines."""
    from PIL import Image, ImageDraw

    w, h, m = 640, 400, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    pts = r["points"]
    ys = [p["s"] for p in pts] + [r["sharded_s"], r["resident_s"]]
    lo, hi = 0.0, max(ys) * 1.1

    def xy(frac: float, s: float) -> tuple[float, float]:
        return m + frac * (w - 2 * m), h - m - (s - lo) / (hi - lo) * (h - 2 * m)

    d.line([xy(0, lo), xy(1, lo)], fill="black")
    d.line([xy(0, lo), xy(0, hi)], fill="black")
    for level, colour, label in ((r["sharded_s"], (200, 60, 60), "sharded, no budget"),
                                 (r["resident_s"], (60, 140, 60), "hsdp.resident")):
        d.line([xy(0, level), xy(1, level)], fill=colour)
        d.text((xy(1, level)[0] - 130, xy(1, level)[1] - 14), f"{label} {level * 1e3:.0f} ms", fill=colour)
    line = [xy(p["budget"] / r["whole_bytes"], p["s"]) for p in pts]
    d.line(line, fill=(40, 80, 200), width=2)
    for px, py in line:
        d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=(40, 80, 200))
    for i in range(5):
        frac = i / 4
        d.text((xy(frac, lo)[0] - 10, h - m + 6), f"{frac:.2f}", fill="black")
        s = lo + (hi - lo) * frac
        d.text((6, xy(0, s)[1] - 6), f"{s * 1e3:.0f} ms", fill="black")
    d.text((w // 2 - 150, h - 22), "resident_bytes / whole model (per rank)", fill="black")
    d.text((m, 12), f"s/step, '{r['preset']}' preset, {r['tokens']} tokens, {r['ranks']} ranks", fill="black")
    img.save(path)


def main(args: argparse.Namespace) -> None:
    from harness import launch, machine, table

    extra = ["--preset", args.preset, "--frames", str(args.frames), "--size", str(args.size),
             "--reps", str(args.reps), "--points", str(args.points)]
    line = next(l for l in launch(args.ranks, "bench/bench_resident.py", "--rank", *extra).splitlines()
                if l.startswith("RESULT "))
    r = json.loads(line[7:])
    print(f"Step time against the residency budget: '{r['preset']}' preset, {r['tokens']} tokens, "
          f"{r['ranks']} ranks ({machine()}); median seconds per forward")
    mib = 1 << 20
    rows = [["sharded, no budget", "-", "-", "-", f"{r['sharded_s']:.3f}", "1.000"]]
    for p in r["points"]:
        rows.append([f"resident_bytes={p['budget'] / mib:.1f} MiB ({p['budget'] / r['whole_bytes']:.2f} x model)",
                     f"{p['resident_units']}/{p['units']} ({p['resident_bytes'] / mib:.1f} MiB)", str(p["gathers"]),
                     f"{p['bytes_per_gather'] / mib:.2f}", f"{p['s']:.3f}", f"{p['s'] / r['sharded_s']:.3f}"])
    rows.append(["hsdp.resident (whole model)", "all", "0", "-", f"{r['resident_s']:.3f}",
                 f"{r['resident_s'] / r['sharded_s']:.3f}"])
    print(table(["path", "units kept (bytes)", "gathers / step", "MiB / gather", "s / step", "vs sharded"], rows))
    if args.png:
        draw(r, args.png)
        print(f"curve: {args.png}")


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    a = parse(sys.argv[1:])
    rank_main(a) if a.rank else main(a)
