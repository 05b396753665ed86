"""One rank of a multi-rank checkpoint test (started by tests/test_checkpoint_multirank.py).

`python tests/ckpt_worker.py REPLICATE[,REPLICATE...] DIR` runs every check below on a
(REPLICATE, world // REPLICATE) mesh (each mesh in turn: one launch covers every mesh of its
world size) with the checkpoints the test wrote into DIR. On every
rank, the model loaded streaming must equal one loaded whole and then sharded, bit for bit
(16-bit sources: the source file's values, decoded with numpy alone),
and the bytes each rank read must add up to each byte read once per shard group. A failure raises
out of main; hsdp then skips MPI_Finalize at exit, so mpiexec ends the other ranks instead
of leaving them waiting in a collective.
"""

from __future__ import annotations

import gc
import json
import struct
import sys
from pathlib import Path

import numpy as np

import hsdp
from hsdp import models, nn
from hsdp.checkpoint import (
    CheckpointKeyError,
    load_model_sharded,
    load_model_whole,
    load_report,
    open_checkpoint,
    stream,
)
from hsdp.world.distributed import init_process_group


def meta(preset: str, variant: str):
    with nn.meta_init():
        return models.make_model(preset, variant=variant)


def all_ranks_sum(world, value: int) -> int:
    send = np.array([value], dtype=np.uint64)
    recv = np.zeros(world.size, dtype=np.uint64)
    world.all_gather(send, recv)
    return int(recv.sum())


def expected_bytes(model, path, R: int, world_size: int, every_replica: bool) -> int:
    """Sharded parameters: once per shard group position (R times if every replica reads);
    parameters kept whole: once per rank."""
    sharded = {id(p) for u in hsdp.get_units(model) for p in u.params}
    with open_checkpoint(path) as ck:
        total = 0
        for n, p in model.named_parameters():
            nbytes = ck[n].nbytes
            total += nbytes * ((R if every_replica else 1) if id(p) in sharded else world_size)
    return total


def check_same_load(world, R: int, path: Path, preset: str, variant: str, every_replica: bool = False) -> None:
    config = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R)
    device = None if variant == "plain" else "cpu"
    ref = models.make_model(preset, variant=variant, seed=42)  # other values: the load must replace them
    load_model_whole(ref, path, progress=False)
    hsdp.apply_hsdp_to_model(ref, config, device)
    seen: list = []
    model = load_model_sharded(meta(preset, variant), path, config, device, progress=seen.append,
                               read_on_every_replica=every_replica)
    for a, b in zip(hsdp.get_units(model), hsdp.get_units(ref), strict=True):
        assert a.fqn == b.fqn and np.array_equal(a.unit.shard_bytes(), b.unit.shard_bytes()), a.label
    x = models.make_inputs(preset, seed=3)
    out = model(*x)
    assert np.array_equal(out, ref(*x)), (path.name, np.abs(out - ref(*x)).max())
    report = load_report(model)
    total = all_ranks_sum(world, report.bytes_read)
    assert total == expected_bytes(model, path, R, world.size, every_replica), (path.name, total)
    assert report.bytes_read_total == total
    if world.rank == 0:  # progress only on rank 0, every unit, all ranks' bytes
        assert [s.done for s in seen] == list(range(1, len(model.blocks) + 2)) and seen[-1].bytes_read == total
    else:
        assert seen == []
    if R > 1 and not every_replica:
        mesh = hsdp.init_device_mesh("cpu", (R, world.size // R))
        sharded = {id(p) for u in hsdp.get_units(model) for p in u.params}
        with open_checkpoint(path) as ck:
            whole = sum(ck[n].nbytes for n, p in model.named_parameters() if id(p) not in sharded)
        # replica 0 reads the shards, the other replicas receive them
        assert (report.bytes_read > whole) == (mesh.replicate_rank == 0), (report.bytes_read, whole)


def source_values(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a one-file checkpoint as float32, decoded from the file's own bytes
    with numpy alone (BF16: the top half of a float32; F16: numpy's float16), exact."""
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    data = raw[8 + hlen:]
    out = {}
    for name, e in json.loads(raw[8:8 + hlen]).items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        if e["dtype"] == "BF16":
            v = (np.frombuffer(data[b:end], np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif e["dtype"] == "F16":
            v = np.frombuffer(data[b:end], np.float16).astype(np.float32)
        else:
            assert e["dtype"] == "F32", e["dtype"]
            v = np.frombuffer(data[b:end], np.float32)
        out[name] = v.reshape(e["shape"])
    return out


def check_exact_from_source(world, R: int, path: Path) -> None:
    """A 16-bit source streamed into float32 parameters, each rank reading and widening its
    own slice of every tensor: the full parameters (every rank's shard, gathered) equal the
    source's values bit for bit. Reading a neighbour's slice (the widening path's offset off
    by a slice) would show here on any rank past the first."""
    config = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R, param_dtype="float32")
    model = load_model_sharded(meta("tiny", "plain"), path, config, progress=False)
    hsdp.unshard(model, recurse=True)
    want = source_values(path)
    try:
        names = [n for n, _ in model.named_parameters()]
        assert sorted(names) == sorted(want), (names, sorted(want))
        for n, p in model.named_parameters():
            got = np.asarray(p.data)
            assert got.dtype == np.float32 and got.shape == want[n].shape, (n, got.dtype, got.shape)
            assert np.array_equal(got.view(np.uint32), want[n].view(np.uint32)), (path.name, n)
    finally:
        hsdp.reshard(model, recurse=True)


def check_failure_on_one_rank(world, R: int, path: Path) -> None:
    """An I/O error on rank 1 only: every rank raises, none hangs, no unit stays usable."""
    config = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R)
    real = stream._fill

    def failing(st, plan):
        if world.rank == 1 and st.label == "blocks.1":
            raise OSError(5, "injected read failure")
        return real(st, plan)

    stream._fill = failing
    model = meta("tiny", "plain")
    try:
        load_model_sharded(model, path, config, progress=False)
    except OSError as e:
        assert world.rank == 1 and "injected read failure" in str(e), e
    except RuntimeError as e:
        assert world.rank != 1 and "loading unit 'blocks.1' failed on rank 1" in str(e) and "injected" in str(e), e
    else:
        raise AssertionError("the load did not fail")
    finally:
        stream._fill = real
    units = [m._hsdp_unit for m in model.modules() if getattr(m, "_hsdp_unit", None)]
    assert [u.label for u in units] == ["blocks.0", "blocks.1"] and all(u.broken for u in units)
    try:
        model(*models.make_inputs("tiny"))
    except RuntimeError:
        pass
    else:
        raise AssertionError("a model whose load failed ran a forward")


def check_missing_key(world, R: int, path: Path) -> None:
    """Validation fails the same way on every rank, before anything is sharded."""
    config = hsdp.HSDPInferenceConfig(enabled=True, hsdp_replicate_size=R)
    model = meta("tiny", "plain")
    try:
        load_model_sharded(model, path, config, key_map=lambda n: None if n == "head.bias" else n, progress=False)
    except CheckpointKeyError as e:
        assert "1 missing: 'head.bias'" in str(e), e
    else:
        raise AssertionError("a missing key was not reported")
    assert all(p.is_meta for p in model.parameters())


def main() -> None:
    root = Path(sys.argv[2])
    world = init_process_group()
    for R in (int(r) for r in sys.argv[1].split(",")):
        run_mesh(world, R, root)


def run_mesh(world, R: int, root: Path) -> None:
    checks = [
        ("reference file", lambda: check_same_load(world, R, root / "ref_tiny.safetensors", "tiny", "plain")),
        ("multi-file", lambda: check_same_load(
            world, R, root / "small" / "model.safetensors.index.json", "small", "plain")),
        ("quantized", lambda: check_same_load(world, R, root / "quant_tiny.safetensors", "tiny", "quantized")),
        ("ignored", lambda: check_same_load(world, R, root / "ignored_tiny.safetensors", "tiny", "ignored")),
        ("bf16 source", lambda: check_exact_from_source(world, R, root / "bf16_tiny.safetensors")),
        ("f16 source", lambda: check_exact_from_source(world, R, root / "f16_tiny.safetensors")),
        ("failure", lambda: check_failure_on_one_rank(world, R, root / "ref_tiny.safetensors")),
        ("missing key", lambda: check_missing_key(world, R, root / "ref_tiny.safetensors")),
    ]
    if R > 1:
        checks.append(("every replica reads", lambda: check_same_load(
            world, R, root / "ref_tiny.safetensors", "tiny", "plain", every_replica=True)))
    for _, fn in checks:
        fn()
        gc.collect()
        world.barrier()
    names = ", ".join(n for n, _ in checks)
    print(f"rank {world.rank}/{world.size} mesh ({R}x{world.size // R}): {names} OK", flush=True)


if __name__ == "__main__":
    # A failure raises out of main: hsdp then leaves MPI unfinalised at exit, so mpiexec ends
    # the job instead of leaving the other ranks waiting in a collective.
    main()
