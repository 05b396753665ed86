"""atheris harness over the safetensors header parser and validator (hsdp.checkpoint.format).

Each input is a file: byte 0 chooses strict mode and the parser's window size (1 to 128
bytes, so members cross window edges all the time), byte 1 the length of a zeroed data
section, the rest is the header (or, with bit 7 of byte 0 set, the whole file, length field
included). What must hold for every input:

- the only exception is CheckpointError (anything else is a bug: an escape), and its
  message is at most MAX_MESSAGE_CHARS long;
- an accepted header is valid JSON by `json.loads`, an object whose entries are exactly
  what the parser kept (names, dtypes, shapes, offsets), and in strict mode its tensors
  tile the data section as the reference package requires;
- every accepted tensor reads (`read_tensor`) without error.

    make fuzz-smoke     # 60 s
    make fuzz           # 10M executions (FUZZ_RUNS)
    python fuzz/fuzz_header.py CORPUS_DIR -atheris_runs=N   # by hand; PYTHONPATH must find hsdp
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from hsdp.checkpoint import CheckpointError
    from hsdp.checkpoint import format as fmt
    from hsdp.checkpoint.errors import MAX_MESSAGE_CHARS
    from hsdp.checkpoint.whole import read_tensor

from hsdp.distributed import init_process_group

init_process_group("single")
_DIR = tempfile.mkdtemp(prefix="hsdp-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
_PATH = os.path.join(_DIR, "input.safetensors")


def _file(data: bytes) -> tuple[bytes, bool, int]:
    if len(data) < 2:
        return data, True, 1 << 20
    flags, data_len, rest = data[0], data[1], data[2:]
    strict, window = bool(flags & 1), 1 + ((flags >> 1) & 63) * 2
    if flags & 0x80:
        return rest, strict, window
    return struct.pack("<Q", len(rest)) + rest + bytes(data_len), strict, window


def _reference_view(header: bytes) -> dict:
    """The header as json sees it; raising is a finding (the parser accepted non-JSON)."""

    def no_dups(pairs: list) -> dict:
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"accepted a repeated key: {keys!r:.200}"
        return dict(pairs)

    obj = json.loads(header.decode("utf-8"), object_pairs_hook=no_dups)
    assert isinstance(obj, dict)
    return obj


def TestOneInput(data: bytes) -> None:
    raw, strict, window = _file(data)
    with open(_PATH, "wb") as f:
        f.write(raw)
    fmt._WINDOW_BYTES = window
    try:
        sf = fmt.open_safetensors(_PATH, strict=strict)
    except CheckpointError as e:
        assert len(str(e)) <= MAX_MESSAGE_CHARS, len(str(e))
        return
    with sf:
        (hlen,) = struct.unpack("<Q", raw[:8])
        obj = _reference_view(raw[8 : 8 + hlen])
        meta = obj.pop("__metadata__", None)
        assert sf.metadata == meta
        assert sf.entries is not None and len(sf.entries) == len(obj)
        data_len = len(raw) - 8 - hlen
        ranges = []
        for name, info in obj.items():
            e = sf.entries[name]
            assert fmt.dtype_to_safetensors(e.dtype) == info["dtype"], name
            assert list(e.shape) == info["shape"], name
            begin, end = info["data_offsets"]
            assert (e.offset, e.nbytes) == (8 + hlen + begin, end - begin), name
            ranges.append((begin, end))
            if e.nbytes <= 1 << 16:
                read_tensor(e)
        if strict:
            at = 0
            for begin, end in sorted(ranges):
                assert begin == at, (begin, at)
                at = end
            assert at == data_len


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
