"""Safetensors checkpoints in one process (a world of one): the format against the reference
`safetensors` package both ways, every validation rule with a crafted file, the streaming
load against load-whole-then-shard, names, key_map, progress and failures.

Multi-rank loads are in tests/test_checkpoint_multirank.py."""

from __future__ import annotations

import gc
import json
import logging
import os
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy as stnp

import hsdp
from hsdp import models, nn
from hsdp.checkpoint import (
    CheckpointError,
    CheckpointKeyError,
    load_checkpoint,
    load_model_sharded,
    load_model_whole,
    load_report,
    open_checkpoint,
    save_checkpoint,
)
from hsdp.world.distributed import init_process_group

init_process_group("single")

# safetensors name, hsdp name
DTYPES = [
    ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("U16", "uint16"), ("I16", "int16"),
    ("F16", "float16"), ("BF16", "bfloat16"), ("U32", "uint32"), ("I32", "int32"),
    ("F32", "float32"), ("F64", "float64"), ("U64", "uint64"), ("I64", "int64"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
]


@pytest.fixture(autouse=True)
def _collect():
    yield
    gc.collect()


def cfg(**kw):
    kw.setdefault("enabled", True)
    return hsdp.HSDPInferenceConfig(**kw)


def meta_model(preset="tiny", variant="plain"):
    with nn.meta_init():
        return models.make_model(preset, variant=variant)


def values_for(name: str, shape=(3, 5), seed=0):
    """(values as hsdp holds them, raw little-endian bytes as a file must store them)."""
    rng = np.random.default_rng(seed)
    dt = hsdp.dtypes.as_dtype(name)
    if name == "bool":
        v = rng.random(shape) < 0.5
    elif not dt.is_floating_point:
        info = np.iinfo(dt.compute)
        v = rng.integers(info.min, info.max, size=shape, dtype=dt.compute, endpoint=True)
    else:
        v = (rng.standard_normal(shape) * 4).astype(np.float32)
        if dt.compute.name != name:
            v = hsdp._C.round_to(v, name)  # exactly representable: the round trip is exact
            return v, hsdp._C.encode(v, name).tobytes()
        v = v.astype(dt.compute)
    return v, np.ascontiguousarray(v).tobytes()


# --------------------------------------------------------------------------- format vs the reference


@pytest.mark.parametrize("st_name,name", DTYPES)
def test_every_dtype_round_trips_with_the_reference(tmp_path, st_name, name):
    vals, raw = values_for(name)
    # ours -> the reference reader (raw bytes for every dtype, NumPy arrays where it has them)
    ours = tmp_path / "ours.safetensors"
    save_checkpoint({"t": (vals, name), "empty": (vals[:0], name), "scalar": (vals[0, 0], name)}, ours)
    got = dict(safetensors.deserialize(ours.read_bytes()))
    assert got["t"]["dtype"] == st_name and got["t"]["shape"] == [3, 5]
    assert bytes(got["t"]["data"]) == raw
    assert got["empty"]["shape"] == [0, 5] and got["scalar"]["shape"] == []
    # the reference's writer -> ours
    ref = tmp_path / "ref.safetensors"
    buf = np.frombuffer(raw, dtype=np.uint8).copy()
    spec = safetensors.TensorSpec(dtype=name, shape=[3, 5], data_ptr=buf.ctypes.data, data_len=buf.nbytes)
    safetensors.serialize_file({"t": spec}, str(ref), metadata={"k": "v"})
    loaded = load_checkpoint(ref)
    assert loaded["t"].dtype == hsdp.dtypes.as_dtype(name).compute
    assert np.array_equal(loaded["t"], vals)
    with open_checkpoint(ref) as ck:
        assert ck["t"].dtype == name and ck.metadata == {"k": "v"}


def test_reference_numpy_reader_reads_our_files(tmp_path):
    model = models.make_model("tiny", seed=0)
    path = tmp_path / "m.safetensors"
    save_checkpoint(model, path, metadata={"format": "np"})
    ref = stnp.load_file(str(path))
    assert set(ref) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        assert ref[n].dtype == np.float32 and np.array_equal(ref[n], p.data), n
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "np"}
    # A bfloat16 model writes BF16, rounded exactly as its parameters hold the values.
    bf = models.make_model("tiny", seed=0, dtype="bfloat16")
    save_checkpoint(bf, tmp_path / "bf.safetensors")
    entries = dict(safetensors.deserialize((tmp_path / "bf.safetensors").read_bytes()))
    w = bf.blocks[0].ffn[0].weight
    assert entries["blocks.0.ffn.0.weight"]["dtype"] == "BF16"
    assert bytes(entries["blocks.0.ffn.0.weight"]["data"]) == hsdp._C.encode(w.data, "bfloat16").tobytes()


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="__metadata__"):
        save_checkpoint({"__metadata__": np.zeros(2)}, tmp_path / "a.safetensors")
    with pytest.raises(TypeError, match="metadata"):
        save_checkpoint({"a": np.zeros(2)}, tmp_path / "a.safetensors", metadata={"a": 1})
    with pytest.raises(TypeError, match="'a'.*no safetensors"):
        save_checkpoint({"a": np.zeros(2, np.complex64)}, tmp_path / "a.safetensors")
    with pytest.raises(TypeError, match="'a'.*int8"):
        save_checkpoint({"a": (np.zeros(2, np.float32), "int8")}, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="index.json"):
        save_checkpoint({"a": np.zeros(2)}, tmp_path / "a.safetensors", max_shard_bytes=8)
    assert not list(tmp_path.iterdir())  # nothing half-written is left behind


# --------------------------------------------------------------------------- validation, crafted files


def craft(path, header, data=b"", hlen=None):
    """A file with this header (a dict, or raw bytes) and data section."""
    if header is None:  # no header at all: just these bytes
        path.write_bytes(data)
        return path
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


GOOD = entry()
CASES = {
    "too short": (None, None, bytes(5), "too short", None),
    "empty header": (b"", None, b"", "not valid UTF-8 JSON", None),
    "truncated data": ({"ok": GOOD, "bad": entry(offsets=(8, 16))}, None, bytes(12), "run past the end", "bad"),
    "truncated header": ({"ok": GOOD}, 4096, bytes(8), "runs past the end", None),
    "huge header length": ({"ok": GOOD}, 200_000_000, bytes(8), "exceeds", None),
    "bad json": (b'{"ok": {"dtype": "F32",', None, b"", "not valid UTF-8 JSON", None),
    "not utf-8": (b'{"\xff": 1}', None, b"", "not valid UTF-8 JSON", None),
    "not an object": (b"[1, 2]", None, b"", "must be a JSON object", None),
    "unknown dtype": ({"ok": GOOD, "bad": entry(dtype="F4", offsets=(8, 16))}, None, bytes(16), "unknown dtype", "bad"),
    "wrong size": ({"ok": GOOD, "bad": entry(shape=(3,), offsets=(8, 16))}, None, bytes(20), "needs 12 bytes", "bad"),
    "out of range": ({"ok": GOOD, "bad": entry(offsets=(1000, 1008))}, None, bytes(16), "run past the end", "bad"),
    "overlap": ({"ok": GOOD, "bad": entry(offsets=(4, 12))}, None, bytes(16), "overlap .*'ok'", "bad"),
    "reversed offsets": ({"ok": GOOD, "bad": entry(offsets=(8, 0))}, None, bytes(16), "begin <= end", "bad"),
    "negative shape": ({"ok": GOOD, "bad": entry(shape=(-2,))}, None, bytes(8), "non-negative", "bad"),
    "float shape": ({"ok": GOOD, "bad": entry(shape=(2.0,))}, None, bytes(8), "non-negative integers", "bad"),
    "missing offsets": ({"ok": GOOD, "bad": {"dtype": "F32", "shape": [2]}}, None, bytes(16), "no 'data_offsets'",
                        "bad"),
    "bad metadata": ({"__metadata__": {"a": 1}, "ok": GOOD}, None, bytes(8), "__metadata__", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validation_rejects_crafted_file(tmp_path, case):
    header, hlen, data, pattern, tensor = CASES[case]
    path = craft(tmp_path / "bad.safetensors", header, data, hlen)
    with pytest.raises(CheckpointError, match=pattern) as info:
        open_checkpoint(path)
    msg = str(info.value)
    assert str(path) in msg
    assert (f"tensor '{tensor}'" in msg) if tensor else ("header" in msg)


def test_duplicate_names_are_rejected(tmp_path):
    raw = b'{"w": ' + json.dumps(GOOD).encode() + b', "w": ' + json.dumps(entry(offsets=(8, 16))).encode() + b"}"
    path = craft(tmp_path / "dup.safetensors", raw, bytes(16))
    with pytest.raises(CheckpointError, match=r"tensor 'w'.*more than once"):
        open_checkpoint(path)
    assert CheckpointError.__mro__[1] is ValueError


def test_the_crafted_valid_file_is_accepted(tmp_path):
    """The crafting helper itself makes files the reader accepts (so the failures above are
    the rules, not the helper)."""
    data = np.arange(4, dtype=np.float32).tobytes()
    header = {"ok": GOOD, "b": entry(offsets=(8, 16)), "z": entry(shape=(0,), offsets=(8, 8))}
    path = craft(tmp_path / "ok.safetensors", header, data)
    got = load_checkpoint(path)
    assert np.array_equal(got["ok"], [0, 1]) and np.array_equal(got["b"], [2, 3]) and got["z"].shape == (0,)
    assert set(stnp.load_file(str(path))) == {"ok", "b", "z"}


def test_validation_happens_before_any_data_is_read(tmp_path):
    """A file whose first tensors are fine and whose last entry is bad: the load fails with
    the model untouched (still meta, no unit, no hook), i.e. nothing was read or sharded."""
    model = models.make_model("tiny", seed=0)
    path = tmp_path / "m.safetensors"
    save_checkpoint(model, path)
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    last = list(header)[-1]
    header[last]["data_offsets"][1] += 4  # its size no longer matches its shape
    craft(path, header, raw[8 + hlen :] + bytes(4))
    meta = meta_model()
    with pytest.raises(CheckpointError, match=f"tensor '{last}'"):
        load_model_sharded(meta, path, cfg())
    assert all(p.is_meta for p in meta.parameters())
    assert not any(getattr(m, "_hsdp_unit", None) for m in meta.modules())
    assert all(not m._forward_pre_hooks for m in meta.modules())
    assert hsdp.memory_stats()["sharded_bytes"] == 0


# --------------------------------------------------------------------------- streaming vs whole


def whole_then_sharded(path, variant, config, target_device=None, **kw):
    model = models.make_model("tiny", variant=variant, seed=99)  # other values: the load must replace them
    load_model_whole(model, path, progress=False, **kw)
    return hsdp.apply_hsdp_to_model(model, config, target_device)


@pytest.mark.parametrize(
    "variant,param_dtype,ckpt_dtype",
    [("plain", "bfloat16", None), ("plain", "float32", None), ("plain", "bfloat16", "bfloat16"),
     ("ignored", "bfloat16", None), ("quantized", "bfloat16", None), ("plain", "float16", "float8_e4m3fn")],
)
def test_streaming_equals_whole_then_shard(tmp_path, variant, param_dtype, ckpt_dtype):
    src = models.make_model("tiny", variant=variant, seed=0)
    path = tmp_path / "m.safetensors"
    if ckpt_dtype is None:  # the reference writer, float32
        stnp.save_file({n: p.data for n, p in src.named_parameters()}, str(path))
    else:  # ours, floating weights rounded to ckpt_dtype
        save_checkpoint({n: (p.data, ckpt_dtype) if p.is_floating_point() and p.ndim else p
                         for n, p in src.named_parameters()}, path)
    c = cfg(param_dtype=param_dtype)
    device = None if variant == "plain" else "cpu"
    model = meta_model(variant=variant)
    assert load_model_sharded(model, path, c, device, progress=False) is model
    ref = whole_then_sharded(path, variant, c, device)
    for a, b in zip(hsdp.get_units(model), hsdp.get_units(ref)):
        assert a.fqn == b.fqn and np.array_equal(a.unit.shard_bytes(), b.unit.shard_bytes()), a.label
    x = models.make_inputs("tiny", seed=5)
    out = model(*x)
    assert np.array_equal(out, ref(*x))
    if ckpt_dtype is None and param_dtype == "float32" and variant == "plain":
        assert np.array_equal(out, src(*x))  # and, in float32, the unsharded source model
    for n, p in model.named_parameters():  # parameters kept whole got their exact values
        if n in dict(ref.named_parameters()) and p._hsdp_state is None:
            assert np.array_equal(p.data, dict(ref.named_parameters())[n].data), n
    report = load_report(model)
    with open_checkpoint(path) as ck:
        assert report.bytes_read == ck.nbytes  # S = 1: every byte once, nothing more
    assert report.units == len(model.blocks) + 1 and report.strategy == "streaming"


def test_multi_file_checkpoint(tmp_path):
    src = models.make_model("small", seed=0)
    index = tmp_path / "model.safetensors.index.json"
    written = save_checkpoint(src, index, metadata={"format": "np"}, max_shard_bytes=1_000_000)
    files = written[:-1]
    assert len(files) >= 4 and all(f.stat().st_size <= 1_000_000 + 65536 for f in files)
    wm = json.loads(index.read_text())["weight_map"]
    assert set(wm) == {n for n, _ in src.named_parameters()} and set(wm.values()) == {f.name for f in files}
    for f in files:  # each file is a plain safetensors file to the reference reader
        assert set(stnp.load_file(str(f))) == {n for n, v in wm.items() if v == f.name}
    one = tmp_path / "one.safetensors"
    save_checkpoint(src, one)
    x = models.make_inputs("small", seed=2)
    expect = load_model_sharded(meta_model("small"), one, cfg(), progress=False)(*x)
    for where in (index, tmp_path / "model.safetensors.index.json"):
        assert np.array_equal(load_model_sharded(meta_model("small"), where, cfg(), progress=False)(*x), expect)
    one.unlink()
    assert np.array_equal(load_model_sharded(meta_model("small"), tmp_path, cfg(), progress=False)(*x), expect)
    got = load_checkpoint(index)
    assert all(np.array_equal(got[n], p.data) for n, p in src.named_parameters())


def _index_case(tmp_path, change):
    index = tmp_path / "m.safetensors.index.json"
    files = save_checkpoint({"a": np.ones(4, np.float32), "b": np.zeros(4, np.float32), "c": np.ones(2, np.int8)},
                            index, max_shard_bytes=20)  # files: [a], [b, c]
    obj = json.loads(index.read_text())
    change(obj, files, tmp_path)
    index.write_text(json.dumps(obj))
    return index


INDEX_CASES = {
    "missing file": (lambda o, f, d: o["weight_map"].update(c="gone.safetensors"), "'gone.safetensors'.*does not exist",
                     "c"),
    "wrong file": (lambda o, f, d: o["weight_map"].update(c=f[0].name), "puts it in 'm-00001.*stored in 'm-00002", "c"),
    "listed but absent": (lambda o, f, d: o["weight_map"].update(d=f[0].name), "does not hold it", "d"),
    "unlisted tensor": (lambda o, f, d: o["weight_map"].pop("c"), "does not list it", "c"),
    "two files": (lambda o, f, d: save_checkpoint({"b": np.zeros(4, np.float32), "a": np.ones(4, np.float32)}, f[1]),
                  "stored in both", "a"),
    "escapes the directory": (lambda o, f, d: o["weight_map"].update(a="../a.safetensors"),
                              "file name in the index's directory", "a"),
    "no weight_map": (lambda o, f, d: o.pop("weight_map"), "'weight_map'", None),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_multi_file_validation(tmp_path, case):
    change, pattern, tensor = INDEX_CASES[case]
    index = _index_case(tmp_path, change)
    with pytest.raises(CheckpointError, match=pattern) as info:
        open_checkpoint(index)
    assert str(index) in str(info.value)
    if tensor:
        assert f"tensor '{tensor}'" in str(info.value)


def test_index_with_bad_json(tmp_path):
    (tmp_path / "m.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON"):
        open_checkpoint(tmp_path)


# --------------------------------------------------------------------------- names, shapes, dtypes


def test_key_map_renames_and_drops(tmp_path):
    src = models.make_model("tiny", seed=0)
    path = tmp_path / "m.safetensors"
    tensors = {f"model.diffusion.{n}": p.data for n, p in src.named_parameters()}
    tensors["ema.step"] = np.array(7, dtype=np.int64)
    save_checkpoint(tensors, path)

    def key_map(name: str) -> str | None:
        return name.removeprefix("model.diffusion.") if name.startswith("model.") else None

    x = models.make_inputs("tiny", seed=1)
    expect = whole_then_sharded(path, "plain", cfg(), key_map=key_map)(*x)
    got = load_model_sharded(meta_model(), path, cfg(), key_map=key_map, progress=False)(*x)
    assert np.array_equal(got, expect)
    # a dict works too (names it does not list stay as they are, so ema.step is unexpected)
    table = {k: k.removeprefix("model.diffusion.") for k in tensors if k.startswith("model.")}
    with pytest.raises(CheckpointKeyError, match=r"1 unexpected: 'ema\.step'"):
        load_model_sharded(meta_model(), path, cfg(), key_map=table, progress=False)
    with pytest.raises(CheckpointError, match="both map to 'head.weight'"):
        load_model_sharded(meta_model(), path, cfg(), key_map=lambda n: "head.weight", progress=False)


def test_missing_and_unexpected_keys_in_one_error(tmp_path):
    src = models.make_model("tiny", seed=0)
    tensors = {n: p.data for n, p in src.named_parameters()}
    tensors.pop("head.weight")
    tensors.pop("blocks.1.ffn.0.bias")
    tensors["blocks.9.extra"] = np.zeros(3, np.float32)
    path = tmp_path / "m.safetensors"
    save_checkpoint(tensors, path)
    model = meta_model()
    with pytest.raises(CheckpointKeyError) as info:
        load_model_sharded(model, path, cfg(), progress=False)
    msg = str(info.value)
    assert "2 missing: 'blocks.1.ffn.0.bias', 'head.weight'" in msg
    assert "1 unexpected: 'blocks.9.extra'" in msg and str(path) in msg
    assert isinstance(info.value, KeyError)
    assert all(p.is_meta for p in model.parameters()) and not hsdp.memory_stats()["sharded_bytes"]
    with pytest.raises(CheckpointKeyError, match="2 missing"):  # the whole strategy says the same
        load_model_whole(models.make_model("tiny"), path, progress=False)


def test_shape_and_dtype_mismatch_name_the_tensor(tmp_path):
    src = models.make_model("tiny", variant="quantized", seed=0)
    tensors = {n: p.data for n, p in src.named_parameters()}
    tensors["head.bias"] = np.zeros(7, np.float32)
    tensors["blocks.0.ffn.0.weight"] = tensors["blocks.0.ffn.0.weight"].astype(np.int16)  # int8 parameter
    tensors["blocks.1.ffn.0.weight"] = tensors["blocks.1.ffn.0.weight"].astype(np.float32)
    path = tmp_path / "m.safetensors"
    save_checkpoint(tensors, path)
    model = meta_model(variant="quantized")
    with pytest.raises(CheckpointError) as info:
        load_model_sharded(model, path, cfg(), "cpu", progress=False)
    msg = str(info.value)
    assert f"'{path}', tensor 'head.bias': shape (7,) does not match parameter 'head.bias' of shape (64,)" in msg
    assert "tensor 'blocks.0.ffn.0.weight': dtype int16 cannot be loaded into parameter" in msg
    assert "tensor 'blocks.1.ffn.0.weight': dtype float32 cannot be loaded" in msg
    assert all(p.is_meta for p in model.parameters())


def test_already_sharded_model_is_refused(tmp_path):
    model = models.make_model("tiny", seed=0)
    path = tmp_path / "m.safetensors"
    save_checkpoint(model, path)
    hsdp.apply_hsdp_to_model(model, cfg())
    with pytest.raises(RuntimeError, match="already sharded"):
        load_model_sharded(model, path, cfg(), progress=False)


# --------------------------------------------------------------------------- failures, progress


def test_failure_mid_load_leaves_no_usable_model(tmp_path, monkeypatch):
    from hsdp.checkpoint import stream

    src = models.make_model("tiny", variant="quantized", seed=0)
    path = tmp_path / "m.safetensors"
    save_checkpoint(src, path)
    real = stream._fill
    calls = []

    def failing(st, plan):
        calls.append(st.label)
        if st.label == "blocks.1":
            raise OSError(5, "disk went away")
        return real(st, plan)

    monkeypatch.setattr(stream, "_fill", failing)
    model = meta_model(variant="quantized")
    with pytest.raises(OSError, match="disk went away"):
        load_model_sharded(model, path, cfg(), "cpu", progress=False)
    assert calls == ["blocks.0", "blocks.1"]
    units = [m._hsdp_unit for m in model.modules() if getattr(m, "_hsdp_unit", None)]
    assert [u.label for u in units] == ["blocks.0", "blocks.1"] and all(u.broken for u in units)
    with pytest.raises(RuntimeError, match="unusable: loading .* failed: OSError"):
        x, t_mod, ctx = (np.zeros(s, np.float32) for s in ((1, 4, 32), (1, 6, 32), (1, 2, 32)))
        model.blocks[0](x, t_mod, ctx)
    with pytest.raises(RuntimeError):
        model(*models.make_inputs("tiny"))
    # parameters that were filled whole went back to meta
    assert all(p.is_meta for n, p in model.named_parameters() if p._hsdp_state is None)
    assert load_report(model) is None


def test_file_truncated_after_validation_fails_in_the_read(tmp_path):
    """The C read path's own error, with the file and the tensor named."""
    src = models.make_model("tiny", seed=0)
    path = tmp_path / "m.safetensors"
    save_checkpoint(src, path)
    with open_checkpoint(path) as ck:
        os.truncate(path, ck["blocks.1.self_attn.q.weight"].offset)
        model = meta_model()
        with pytest.raises(OSError, match=f"'{path}', tensor 'blocks.1.self_attn.q.weight'.*file ends"):
            load_model_sharded(model, ck, cfg(), progress=False)
    assert model.blocks[0]._hsdp_unit.broken and model.blocks[1]._hsdp_unit.broken


def test_progress_lines_and_callback(tmp_path, caplog, monkeypatch):
    from hsdp.checkpoint import progress

    src = models.make_model("tiny", seed=0)
    path = tmp_path / "m.safetensors"
    save_checkpoint(src, path)
    monkeypatch.setattr(progress.Progress, "interval", 0.0)  # no throttle: every unit logs
    with caplog.at_level(logging.INFO, logger="hsdp"):
        load_model_sharded(meta_model(), path, cfg())
    lines = [r.getMessage() for r in caplog.records]
    steps = [m for m in lines if m.startswith("loading: ")]
    assert [s.split(",")[0] for s in steps] == ["loading: 1/3 units", "loading: 2/3 units"]
    assert all(s.endswith("MB/s") and "MB read" in s for s in steps)
    assert any(m.startswith(f"loaded {path}: 3/3 units, 0.2 MB read, ") for m in lines), lines
    assert "Sharded 2 modules + root" in lines and "HSDP applied to model: VideoDiT" in lines
    seen = []
    load_model_sharded(meta_model(), path, cfg(), progress=seen.append)
    assert [s.done for s in seen] == [1, 2, 3] and seen[-1].total == 3
    with open_checkpoint(path) as ck:
        assert seen[-1].bytes_read == ck.nbytes
    caplog.clear()
    monkeypatch.setattr(progress.Progress, "interval", 3600.0)  # throttled: only the ends
    with caplog.at_level(logging.INFO, logger="hsdp"):
        load_model_sharded(meta_model(), path, cfg())
    assert not [r for r in caplog.records if r.getMessage().startswith("loading: ")]


def test_save_creates_missing_folders(tmp_path):
    target = tmp_path / "a" / "b" / "model.safetensors"
    assert hsdp.save_checkpoint({"w": np.arange(3, dtype=np.float32)}, target) == [target]
    assert np.array_equal(hsdp.load_checkpoint(target)["w"], np.arange(3, dtype=np.float32))


# --------------------------------------------------------------------------- review regressions


def test_failed_whole_read_leaves_a_loaded_model_as_it_was(tmp_path):
    """A model that already has weights: a short read among the whole parameters must change
    none of them (all are read before any is assigned)."""
    path = tmp_path / "ig.safetensors"
    save_checkpoint(models.make_model("tiny", variant="ignored", seed=0), path)
    model = models.make_model("tiny", variant="ignored", seed=7)
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    x = models.make_inputs(model.config)
    expect = model(*x)
    ckpt = open_checkpoint(path)
    os.truncate(path, ckpt["time_embedder.2.weight"].offset + 4)
    with pytest.raises(OSError):
        load_model_sharded(model, ckpt, cfg(), "cpu", progress=False)
    ckpt.close()
    for n, p in model.named_parameters():
        assert p._hsdp_state is None and np.array_equal(p.data, before[n]), n
    assert np.array_equal(model(*x), expect)


def test_a_raising_progress_callback_does_not_stop_the_load(tmp_path, caplog):
    path = tmp_path / "m.safetensors"
    save_checkpoint(models.make_model("tiny", seed=0), path)

    def callback(state):
        raise KeyError("boom")

    model = meta_model()
    with caplog.at_level(logging.WARNING, logger="hsdp"):
        load_model_sharded(model, path, cfg(param_dtype="float32"), progress=callback)
    assert "progress callback raised KeyError" in caplog.text
    x = models.make_inputs("tiny")
    assert np.array_equal(model(*x), models.make_model("tiny", seed=0)(*x))


def test_float64_rounds_once_to_bfloat16(tmp_path):
    v = np.array([1 + 2.0**-8 + 2.0**-30, -3.0000001], np.float64)
    once = hsdp._C.round_to(v, "bfloat16")
    assert once[0] == np.float32(1.0078125)  # through float32 first it would be 1.0
    assert np.array_equal(nn.Parameter(v, dtype="bfloat16").data, once)
    path = tmp_path / "w.safetensors"
    save_checkpoint({"w": (v, "bfloat16")}, path)
    assert np.array_equal(load_checkpoint(path)["w"], once)


def test_writer_refuses_integers_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match=r"tensor 'q': values in \[-200, 300\] do not fit int8"):
        save_checkpoint({"q": (np.array([300, -200]), "int8")}, tmp_path / "q.safetensors")
    assert not (tmp_path / "q.safetensors").exists()


def test_writer_errors_name_the_tensor(tmp_path):
    with pytest.raises(RuntimeError, match=r"tensor '[\w.]+': .*meta_init"):
        save_checkpoint(meta_model(), tmp_path / "m.safetensors")
    with pytest.raises(TypeError, match="tensor 'w'"):
        save_checkpoint({"w": (np.zeros(2), "float7")}, tmp_path / "m.safetensors")


@pytest.mark.parametrize("body", [b'{"a": ' + b"1" * 5000 + b"}", b'{"a": ' + b"[" * 100_000])
def test_pathological_headers_are_checkpoint_errors(tmp_path, body):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CheckpointError, match="bad.safetensors.*cannot be parsed"):
        open_checkpoint(path)
    index = tmp_path / "bad.index.json"
    index.write_bytes(body)
    with pytest.raises(CheckpointError, match="bad.index.json.*cannot be parsed"):
        open_checkpoint(index)


def test_every_tied_name_in_the_checkpoint_is_checked(tmp_path):
    class Tied(nn.Module):
        _hsdp_shard_conditions = [lambda name, m: name == "a"]

        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Module()
            self.b.weight = self.a.weight  # tied

    path = tmp_path / "t.safetensors"
    good = Tied()
    tensors = {"a.weight": np.ones((3, 3), np.float32), "a.bias": np.zeros(3, np.float32),
               "b.weight": np.arange(7, dtype=np.int8)}  # the second tied name does not fit
    save_checkpoint(tensors, path)
    with pytest.raises(CheckpointError, match="'b.weight'"):
        load_model_whole(good, path, progress=False)


def test_a_folder_named_like_a_checkpoint_is_not_one(tmp_path):
    (tmp_path / "x.safetensors").mkdir()
    save_checkpoint({"w": np.ones(2, np.float32)}, tmp_path / "real.safetensors")
    assert list(load_checkpoint(tmp_path)) == ["w"]


@pytest.mark.parametrize("what", ["file", "index"])
def test_a_fifo_is_refused_before_it_is_opened(tmp_path, what):
    """Opening a FIFO blocks until a writer comes: refused from its mode, naming it."""
    import os

    import hsdp.checkpoint as ckpt

    fifo = tmp_path / ("model.safetensors" if what == "file" else "model.safetensors.index.json")
    os.mkfifo(fifo)
    with pytest.raises(ckpt.CheckpointError, match="is a FIFO, not a regular file: refused before opening"):
        ckpt.open_checkpoint(fifo)
    with pytest.raises(ckpt.CheckpointError, match="is a FIFO"):
        ckpt.open_checkpoint(tmp_path)  # found in a folder, the same
