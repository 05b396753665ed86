"""Float8's own error on gpu_check.py's block model, through the host decode on the CPU: the
relative L2 of the float8-wire output against the bf16 one, the figure gpu_check's
``wire_fp8`` bound (BLOCKS_FP8_REL_L2) comes from.

    python bench/fp8_block_error.py [TOKENS]    # default 256; the H200 step uses 4096
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import gpu_check  # noqa: E402
import hsdp  # noqa: E402


def main(tokens: int) -> None:
    shape = gpu_check.Blocks(gpu_check.GPU_BLOCKS.dim, gpu_check.GPU_BLOCKS.ffn, gpu_check.GPU_BLOCKS.layers, tokens)
    t0 = time.time()
    out = []
    for wire in (None, "float8_e4m3fn"):
        model = gpu_check.make_blocks(torch, shape)  # seeded: the same weights both times
        hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True, param_dtype="bfloat16",
                                                                 wire_dtype=wire), target_device="cpu")
        x = torch.randn(1, tokens, shape.dim, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out.append(model(x).float())
    rel = float((out[1] - out[0]).norm() / out[0].norm())
    print(f"block model {shape}: float8 wire vs bf16, relative L2 {rel:.4f} ({time.time() - t0:.0f} s, CPU)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
