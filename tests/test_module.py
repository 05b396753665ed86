"""The CPython module hsdp._C follows CPython's conventions for extensions (docs/design.md,
"The CPython module"): multi-phase initialisation with module state, immutable heap types,
and GC support wherever an object holds Python references."""

from __future__ import annotations

import gc
import importlib.util
import weakref

import numpy as np
import pytest

import hsdp
from hsdp import _C


def _group():
    return hsdp.init_device_mesh("cpu", (1, 1)).shard_group


@pytest.mark.parametrize("name", ["Unit", "ProcessGroup", "HSDPInferenceConfig", "WholeBytes"])
def test_types_are_immutable(name):
    t = getattr(_C, name)
    with pytest.raises(TypeError, match="immutable type"):
        t.extra = 1
    assert not hasattr(t, "extra")


def test_each_module_object_has_its_own_state_and_types():
    """Multi-phase init: a second module object made from the same spec is a fresh one, with
    its own types and pool (single-phase init would hand back the cached module's)."""
    spec = importlib.util.find_spec("hsdp._C")
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    assert other is not _C and other.Unit is not _C.Unit and other.Unit.__name__ == "Unit"
    assert other.memory_stats()["pool_capacity"] == 2  # its own, fresh state
    del other
    gc.collect()


def test_a_cycle_through_a_unit_is_collected():
    """Unit holds its params with GC support: the GC sees them and collects a cycle through
    them (a parameter that refers back to its unit), buffers and all."""

    class Param:
        pass

    params = (Param(), Param())
    u = _C.Unit(_group(), ["float32", "float32"], [(4,), (2,)], params=params, bind_attr="_data")
    assert gc.is_tracked(u) and any(r is params for r in gc.get_referents(u))
    params[0].unit = u  # the cycle: unit -> params -> parameter -> unit
    u.unshard()
    assert _C.memory_stats()["unsharded_bytes"] > 0
    alive = weakref.ref(params[0])
    del u, params
    gc.collect()
    assert alive() is None
    assert _C.memory_stats()["unsharded_bytes"] == 0


def test_buffers_and_tokens_are_tracked():
    u = _C.Unit(_group(), ["float32"], [(4,)])
    u.write(0, np.arange(4, dtype=np.float32))
    u.unshard()
    full, _ = u.buffers()
    assert gc.is_tracked(full) and gc.is_tracked(_C.WholeBytes(8))
    del full
    u.reshard()
