"""Figure 4: the Python-side cost of hsdp's hooks per unit per forward.

A model of many tiny units (Linear(8, 8) each; the gather is a copy of a few hundred bytes
in a world of one) runs sharded and unsharded, interleaved; the difference per unit is what
the pre- and post-forward hooks, the schedule and the C calls cost.

    .venv/bin/python bench/bench_hooks.py
"""

from __future__ import annotations

import os
import sys

UNITS = 128


def main() -> None:
    import numpy as np

    import hsdp
    from hsdp import nn
    from harness import interleaved, machine, table

    class Chain(nn.Module):
        _hsdp_shard_conditions = [lambda name, m: name.startswith("layers.") and name.count(".") == 1]

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(UNITS))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def build(shard: bool, depth: int = 1) -> Chain:
        m = Chain()
        rng = np.random.default_rng(0)
        for p in m.parameters():
            p.data = (rng.standard_normal(p.shape) * 0.3).astype(np.float32)
        if shard:
            hsdp.apply_hsdp_to_model(m, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="float32",
                                                                  prefetch_depth=depth))
        return m

    hsdp.distributed.init_process_group("single")
    x = np.ones((1, 8), np.float32)
    plain, on, off = build(False), build(True, 1), build(True, 0)
    assert np.array_equal(on(x), plain(x)) and np.array_equal(off(x), plain(x))
    fns = [lambda: plain(x), lambda: on(x), lambda: off(x)]
    t_plain, t_on, t_off = interleaved(fns, 200)
    per_on = (t_on - t_plain) / UNITS * 1e6
    per_off = (t_off - t_plain) / UNITS * 1e6
    print(f"Hook overhead per unit per forward, {UNITS} units, world of one ({machine()})")
    print(table(["path", "us / forward", "overhead us / unit", "<= 20 us"], [
        ["unsharded", f"{t_plain * 1e6:.0f}", "-", "-"],
        ["sharded, prefetch on", f"{t_on * 1e6:.0f}", f"{per_on:.1f}", "yes" if per_on <= 20 else "no"],
        ["sharded, prefetch off", f"{t_off * 1e6:.0f}", f"{per_off:.1f}", "yes" if per_off <= 20 else "no"],
    ]))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
