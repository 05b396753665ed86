"""The (replicate, shard) device mesh over the world group.

World ranks are laid row-major, ``rank = r * S + s`` (the arithmetic and its one validation
are in the C core, mesh.c): a shard group is S consecutive ranks, a replicate group the
ranks with the same ``s``. Creating a mesh splits the world group, a collective, so every
rank must create the same meshes in the same order; meshes are cached per shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import _C
from . import devices, distributed


def device_type_of(world: _C.ProcessGroup) -> str:
    """The device type of meshes over a world group: the one its backend's buffers are
    viewed as ('cuda' on NCCL, else 'cpu')."""
    return devices.of_group(world).framework


def check_device_type(device_type: str) -> str:
    """The device type, if a backend for it is built and usable here; else the registry's
    reason (NotImplementedError; RuntimeError for 'cuda' on a machine with no GPU), or
    ValueError for a name that is no device type."""
    device_type = "cuda" if device_type == "gpu" else device_type
    names = devices.backends_for(device_type)
    if not names:
        raise ValueError(f"device_type must be one of {', '.join(map(repr, devices.frameworks()))}, got {device_type!r}")
    reasons = [distributed.backend_reason(n) for n in names]  # a CPU mesh never loads NCCL
    if all(r is not None for r in reasons):
        # no GPU: RuntimeError; not built: NotImplementedError (the device backend's loader says)
        on_host = device_type == devices.host_framework()
        kind = NotImplementedError if on_host else devices.error_type(names[0], reasons[0])
        raise kind(f"device_type={device_type!r}: {reasons[0]}")
    return device_type


class DeviceMesh:
    """A 2-D mesh ``(replicate, shard)`` with a process group per dimension."""

    def __init__(
        self,
        device_type: str,
        mesh_shape: Sequence[int],
        *,
        mesh_dim_names: Sequence[str] = ("replicate", "shard"),
    ) -> None:
        self.device_type = check_device_type(device_type)
        shape = tuple(int(x) for x in mesh_shape)
        if len(shape) != 2:
            raise ValueError(f"mesh_shape must be (replicate, shard), got {tuple(mesh_shape)!r}")
        names = tuple(mesh_dim_names)
        if len(names) != 2 or len(set(names)) != 2:
            raise ValueError(f"mesh_dim_names must be two distinct names, got {names!r}")
        if any(x <= 0 for x in shape):
            raise ValueError(f"mesh shape {shape}: both sizes must be positive")
        # a device mesh (GPU) starts its backend's world when none exists (under mpiexec
        # "auto" means MPI); a CPU mesh never starts a device backend
        served = devices.backends_for(self.device_type)
        world = distributed.world_for(self.device_type, f"a {self.device_type!r} mesh")
        if world.backend not in served:  # a CPU mesh over a device world
            raise RuntimeError(
                f"a {self.device_type!r} mesh needs backend {' or '.join(served)}, but "
                f"the process group runs on {world.backend!r}"
            )
        try:
            coords = _C.mesh_coords(world.size, world.rank, *shape)
        except ValueError as exc:
            raise ValueError(f"mesh shape {shape}: {exc}") from None
        replicate, shard = coords["replicate"], coords["shard"]
        self.shape: tuple[int, int] = (replicate, shard)
        self.mesh_dim_names: tuple[str, str] = (names[0], names[1])
        self.world = world
        self.replicate_rank: int = coords["r"]
        self.shard_rank: int = coords["s"]
        self.shard_group_ranks: tuple[int, ...] = coords["shard_group"]
        self.replicate_group_ranks: tuple[int, ...] = coords["replicate_group"]
        # Both splits are collectives over the world: every rank runs them in this order. A
        # dimension whose group is the whole world in world order is the world group itself,
        # on every rank alike (the shape decides): no second communicator of the same ranks
        # (on NCCL each costs its init and its buffers).
        everyone = tuple(range(world.size))
        self.shard_group = (world if self.shard_group_ranks == everyone
                            else world.split(color=coords["r"], key=coords["s"]))
        self.replicate_group = (world if self.replicate_group_ranks == everyone
                                else world.split(color=coords["s"], key=coords["r"]))

    @property
    def ndim(self) -> int:
        return 2

    def size(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            return self.shape[0] * self.shape[1]
        return self.shape[self._dim(mesh_dim)]

    def get_group(self, mesh_dim: int | str) -> _C.ProcessGroup:
        return (self.replicate_group, self.shard_group)[self._dim(mesh_dim)]

    def get_local_rank(self, mesh_dim: int | str) -> int:
        return (self.replicate_rank, self.shard_rank)[self._dim(mesh_dim)]

    def _dim(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"no mesh dimension {mesh_dim!r}; the mesh has {self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if mesh_dim not in (0, 1):
            raise IndexError(f"mesh dimension {mesh_dim} is out of range for a 2-D mesh")
        return mesh_dim

    def __repr__(self) -> str:
        return (
            f"DeviceMesh({self.device_type!r}, shape={self.shape}, "
            f"mesh_dim_names={self.mesh_dim_names}, rank={self.world.rank})"
        )


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] = ("replicate", "shard"),
) -> DeviceMesh:
    """Return the (cached) mesh of this shape, creating it collectively the first time."""
    key = (device_type, tuple(int(x) for x in mesh_shape), tuple(mesh_dim_names))
    mesh = distributed.cached_mesh(key)  # type: ignore[arg-type]
    if mesh is None:
        mesh = DeviceMesh(device_type, mesh_shape, mesh_dim_names=mesh_dim_names)
        distributed.cache_mesh(key, mesh)  # type: ignore[arg-type]
    return mesh
