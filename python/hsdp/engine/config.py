"""``DiffusionParallelConfig``: a diffusion pipeline's parallel settings, mapped onto HSDP.

A pipeline declares its parallel degrees (pipeline, data, tensor, expert, Ulysses and ring
sequence parallel, classifier-free-guidance parallel) and whether to shard its weights with
HSDP. The other degrees multiply into the *other-parallel world*
``pp * dp * tp * sp * cfg`` with ``sp = ulysses * ring``. HSDP then runs in one of two modes:

- **standalone**: every other degree is 1. HSDP alone decides the job size, so the shard size
  must be given explicitly and the world is ``hsdp_replicate_size * hsdp_shard_size``.
- **combined**: some other degree is > 1. HSDP lays its ``(replicate, shard)`` mesh over the
  ranks that parallelism already uses; it adds no ranks, so ``R * S`` must equal the
  other-parallel world. ``hsdp_shard_size=-1`` (the default) means "world // replicate".

Data parallelism (``data_parallel_size=D``) runs under HSDP: the world is D *lanes* of
``cfg * ulysses * ring`` ranks each, every lane serves its own requests, and HSDP lays
``R x S`` over the whole world (``hsdp_shard_size=-1`` derives S = world / R), so the weights
stay sharded across the lanes too; the lanes of one shard group gather in lockstep
(:mod:`hsdp.engine.lockstep`). A lane lies inside one shard group (S is a multiple of the
lane's size). HSDP cannot be combined with tensor, pipeline or expert parallelism: those
already split or place the weights themselves.

Pure Python: the C extension and the process group are imported only inside the methods that
need them, so a config can be built and validated anywhere (argument parsing, tests, tools).
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from . import built
from .dtypes import as_dtype

__all__ = ["DiffusionParallelConfig", "add_parallel_args"]

HSDPMode = Literal["off", "standalone", "combined"]

# Degrees that multiply into the other-parallel world, with the short names used in log lines.
_WORLD_FACTORS: tuple[tuple[str, str], ...] = (
    ("pipeline_parallel_size", "pp"),
    ("data_parallel_size", "dp"),
    ("tensor_parallel_size", "tp"),
    ("ulysses_degree", "ulysses"),
    ("ring_degree", "ring"),
    ("cfg_parallel_size", "cfg"),
)

def _describe_value(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _as_positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1, or ValueError naming the field.

    bool is rejected although it is an int subclass: ``ulysses_degree=True`` is a mistake,
    never a degree of 1. Other integral types (NumPy integers) are accepted via ``__index__``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive int, got {_describe_value(value)}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive int, got {_describe_value(value)}") from None
    if as_int < 1:
        raise ValueError(f"{name} must be a positive int, got {as_int}")
    return as_int


def _as_shard_size(value: Any) -> int:
    """``hsdp_shard_size``: -1 (auto) or an int >= 1."""
    as_int: int | None = None
    if not isinstance(value, bool):
        try:
            as_int = operator.index(value)
        except TypeError:
            pass
    if as_int is None or (as_int != -1 and as_int < 1):
        raise ValueError(
            f"hsdp_shard_size must be -1 (auto) or a positive int, got {_describe_value(value)}"
        )
    return as_int


WIRE_DTYPES = tuple(built.WIRE_DTYPES)  # what hsdp.engine.built lists as built


def _as_wire_dtype(value: Any) -> str | None:
    """None or the one wire format built; float8_e5m2 is a NotImplementedError, the rest a
    ValueError naming the choices."""
    if value is None:
        return None
    try:  # the one reading of a dtype (a name, a NumPy or torch dtype): hsdp.engine.dtypes
        name = as_dtype(value).name
    except (TypeError, ValueError):
        name = None
    if name in WIRE_DTYPES:
        return name
    if name is not None:
        built.check_wire_dtype(name, "hsdp_wire_dtype")
    raise ValueError(f"hsdp_wire_dtype must be None or one of {', '.join(WIRE_DTYPES)}, got {_describe_value(value)}")


def _as_bool(name: str, value: Any) -> bool:
    # Strict: a stray 0/1 or "false" from a hand-written mapping must not flip a mode silently.
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_describe_value(value)}")
    return value


_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_resident_bytes(text: str) -> int | str:
    """A residency budget as text: ``auto``, or bytes with an optional K/M/G/T suffix (powers
    of 1024: ``512M``, ``1.5G``, ``4096``). ValueError naming the value otherwise."""
    if text.strip().lower() == "auto":
        return "auto"
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(
            f"resident bytes must be a byte count with an optional K/M/G/T suffix (e.g. 512M, 2G) "
            f"or 'auto', got {text!r}"
        )
    return int(float(m.group(1)) * _SUFFIX[m.group(2).upper()])


def _cli_resident_bytes(text: str) -> int | str:
    try:
        return parse_resident_bytes(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from None


def _as_resident_bytes(value: Any) -> int | str | None:
    """``hsdp_resident_bytes``: None, an int >= 0, ``"auto"``, or text ``parse_resident_bytes``
    reads."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_resident_bytes(value)
        except ValueError as exc:
            raise ValueError(f"hsdp_resident_bytes: {exc}") from None
    if not isinstance(value, bool):
        try:
            as_int = operator.index(value)
        except TypeError:
            as_int = None
        if as_int is not None and as_int >= 0:
            return as_int
    raise ValueError(
        f"hsdp_resident_bytes must be None, an int >= 0, 'auto' or a size such as '2G', "
        f"got {_describe_value(value)}"
    )


@dataclass
class DiffusionParallelConfig:
    """Parallel degrees of a diffusion pipeline, and HSDP weight sharding on top of them.

    Validated on construction. After ``__post_init__``: ``data_parallel_size`` is an int
    (``None`` meant 1), ``sequence_parallel_size`` is ``ulysses_degree * ring_degree``,
    ``hsdp_shard_size`` is resolved when HSDP is on and it was ``-1``, and ``world_size`` is
    the number of ranks the job needs. Fields are not re-validated if assigned afterwards;
    build a new config with :meth:`replace` (or ``from_dict``) instead. It starts from the
    values as given, so a derived value (an auto shard size, the sequence-parallel size) is
    derived again from the changed degrees.
    """

    pipeline_parallel_size: int = 1
    data_parallel_size: int | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    sequence_parallel_size: int | None = None
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_parallel_size: int = 1
    use_hsdp: bool = False
    hsdp_shard_size: int = -1
    hsdp_replicate_size: int = 1
    # None, or "float8_e4m3fn": shards held and gathered block-scaled (docs/performance.md)
    hsdp_wire_dtype: str | None = None
    # per-rank bytes of units kept gathered across forwards (HSDPInferenceConfig.resident_bytes)
    hsdp_resident_bytes: int | str | None = None
    # ranks of each request's group that share the VAE's tiled decode and encode (hsdp.pipelines.vae)
    vae_patch_parallel_size: int = 1
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        # The two fields resolved below, as given: to_dict and replace start from these so a
        # changed degree re-derives them instead of contradicting a stale derived value.
        object.__setattr__(self, "_given", {"sequence_parallel_size": self.sequence_parallel_size,
                                            "hsdp_shard_size": self.hsdp_shard_size})
        self.enable_expert_parallel = _as_bool(
            "enable_expert_parallel", self.enable_expert_parallel
        )
        self.use_hsdp = _as_bool("use_hsdp", self.use_hsdp)

        self.pipeline_parallel_size = _as_positive_int(
            "pipeline_parallel_size", self.pipeline_parallel_size
        )
        if self.data_parallel_size is None:
            self.data_parallel_size = 1
        self.data_parallel_size = _as_positive_int("data_parallel_size", self.data_parallel_size)
        self.tensor_parallel_size = _as_positive_int(
            "tensor_parallel_size", self.tensor_parallel_size
        )
        self.ulysses_degree = _as_positive_int("ulysses_degree", self.ulysses_degree)
        self.ring_degree = _as_positive_int("ring_degree", self.ring_degree)
        self.cfg_parallel_size = _as_positive_int("cfg_parallel_size", self.cfg_parallel_size)
        self.hsdp_replicate_size = _as_positive_int("hsdp_replicate_size", self.hsdp_replicate_size)
        self.hsdp_shard_size = _as_shard_size(self.hsdp_shard_size)
        self.hsdp_wire_dtype = _as_wire_dtype(self.hsdp_wire_dtype)
        self.hsdp_resident_bytes = _as_resident_bytes(self.hsdp_resident_bytes)
        self.vae_patch_parallel_size = _as_positive_int("vae_patch_parallel_size", self.vae_patch_parallel_size)

        # Classifier-free guidance has exactly two branches (conditional, unconditional), so
        # there is nothing to split across more than two ranks.
        if self.cfg_parallel_size not in (1, 2):
            raise ValueError(
                f"cfg_parallel_size must be 1 or 2 (classifier-free guidance has two branches), "
                f"got {self.cfg_parallel_size}"
            )

        derived_sp = self.ulysses_degree * self.ring_degree
        if self.sequence_parallel_size is not None:
            explicit_sp = _as_positive_int("sequence_parallel_size", self.sequence_parallel_size)
            if explicit_sp != derived_sp:
                raise ValueError(
                    f"sequence_parallel_size={explicit_sp} must equal "
                    f"ulysses_degree={self.ulysses_degree} "
                    f"x ring_degree={self.ring_degree} = {derived_sp}; leave it unset to derive it"
                )
        self.sequence_parallel_size = derived_sp

        self._resolve_world()
        self._check_vae_group()

    def _check_vae_group(self) -> None:
        # The VAE's tiles are spread over ranks that run the same request: the whole world, or
        # with data parallel lanes one lane's ranks. It adds no ranks.
        n, group = self.vae_patch_parallel_size, self.world_size // self.lanes
        if n > group:
            where = (f"the {group} ranks of a data parallel lane (world {self.world_size} / "
                     f"data_parallel_size={self.lanes})" if self.lanes > 1 else f"the world of {group} rank" + ("s" if group > 1 else ""))
            raise ValueError(
                f"vae_patch_parallel_size={n} spreads the VAE's tiles over ranks that run the same request, "
                f"and there are only {where}; use at most {group}")

    def _resolve_world(self) -> None:
        other_world = self.other_parallel_world
        if not self.use_hsdp:
            # The hsdp_* fields are kept as given; they only matter once HSDP is switched on.
            self.world_size = other_world
            return

        self._check_hsdp_exclusions()
        if other_world == 1:
            if self.hsdp_shard_size == -1:
                raise ValueError(
                    "hsdp_shard_size=-1 (auto) sizes the shard group from the other parallel "
                    "degrees, but all of them are 1; standalone HSDP mode needs an explicit "
                    "hsdp_shard_size (e.g. hsdp_shard_size=4 to shard across 4 ranks)"
                )
            self.world_size = self.hsdp_replicate_size * self.hsdp_shard_size
            return
        # Combined: the mesh reuses the ranks of the other parallelism and adds none. The
        # mesh-size rule (-1 resolved, R x S = world) is the C core's (mesh.c), asked here.
        from hsdp._C import mesh_sizes

        try:
            _, self.hsdp_shard_size = mesh_sizes(other_world, self.hsdp_replicate_size, self.hsdp_shard_size)
        except ValueError as exc:
            raise ValueError(
                f"{exc}: here the world is the other-parallel world {other_world} "
                f"({self._factors_text()}); HSDP adds no ranks, so R x S must cover exactly those "
                "ranks (use hsdp_shard_size=-1 to derive S, with a replicate size that divides it)"
            ) from None
        self.world_size = other_world
        if self.data_parallel_size > 1 and self.hsdp_resident_bytes is not None:
            raise NotImplementedError(
                f"hsdp_resident_bytes={self.hsdp_resident_bytes!r} with data_parallel_size={self.data_parallel_size} "
                "is not built yet: the budget is agreed over the shard group at the end of a model's first "
                "forward, which the lanes of a shard group do not reach together; leave hsdp_resident_bytes unset"
            )
        lane = self.lane_size
        if self.data_parallel_size > 1 and self.hsdp_shard_size % lane:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size}: each lane (one request's ranks: "
                f"cfg x ulysses x ring = {lane}) must lie inside one shard group, so hsdp_shard_size "
                f"must be a multiple of {lane}; got hsdp_shard_size={self.hsdp_shard_size} "
                f"(hsdp_replicate_size={self.hsdp_replicate_size}): lower hsdp_replicate_size"
            )

    # ----------------------------------------------------------------- derived values

    @property
    def lane_size(self) -> int:
        """The ranks that run one request together: ``cfg * ulysses * ring`` (one rank when
        none of them is on)."""
        return self.cfg_parallel_size * self.ulysses_degree * self.ring_degree

    @property
    def lanes(self) -> int:
        """How many requests run at once: ``data_parallel_size``."""
        return int(self.data_parallel_size or 1)

    @property
    def other_parallel_world(self) -> int:
        """``pp * dp * tp * sp * cfg``: the ranks the non-HSDP parallelism needs."""
        world = 1
        for name, _ in _WORLD_FACTORS:
            world *= getattr(self, name) or 1  # data_parallel_size may be None before validation
        return world

    @property
    def hsdp_mode(self) -> HSDPMode:
        if not self.use_hsdp:
            return "off"
        return "standalone" if self.other_parallel_world == 1 else "combined"

    def _factors(self, short: bool) -> list[str]:
        return [
            f"{short_name if short else name}={getattr(self, name)}"
            for name, short_name in _WORLD_FACTORS
            if (getattr(self, name) or 1) > 1
        ]

    def _factors_text(self) -> str:
        factors = self._factors(short=False)
        return " x ".join(factors) if factors else "every other degree is 1"

    def _check_hsdp_exclusions(self) -> None:
        # Reported together so one edit fixes the config, not one round trip per conflict.
        conflicts = []
        if self.tensor_parallel_size > 1:
            conflicts.append(f"tensor parallel (tensor_parallel_size={self.tensor_parallel_size})")
        if self.pipeline_parallel_size > 1:
            conflicts.append(
                f"pipeline parallel (pipeline_parallel_size={self.pipeline_parallel_size})"
            )
        if self.enable_expert_parallel:
            conflicts.append("expert parallel (enable_expert_parallel=True)")
        if conflicts:
            raise ValueError(
                "use_hsdp=True cannot be combined with "
                + ", ".join(conflicts)
                + "; HSDP shards the weights itself and works over data, sequence (ulysses/ring) "
                "and CFG parallelism: set those degrees to 1 and enable_expert_parallel=False, "
                "or use_hsdp=False"
            )

    def describe(self) -> str:
        """One line for logs, e.g. ``HSDP standalone: replicate=1 x shard=4 (world 4)``."""
        vae = f"; the VAE's tiles over {self.vae_patch_parallel_size} ranks" if self.vae_patch_parallel_size > 1 else ""
        return self._describe_ranks() + vae

    def _describe_ranks(self) -> str:
        mode = self.hsdp_mode
        if mode == "off":
            details = self._factors(short=True)
            extra = " x ".join(details)
            if self.enable_expert_parallel:
                extra = f"{extra}, expert parallel" if extra else "expert parallel"
            return f"no HSDP: world {self.world_size}" + (f" ({extra})" if extra else "")
        mesh = (
            f"replicate={self.hsdp_replicate_size} x shard={self.hsdp_shard_size} "
            f"(world {self.world_size})"
        )
        if mode == "standalone":
            return f"HSDP standalone: {mesh}"
        lanes = ""
        if self.lanes > 1:
            of = "1 rank" if self.lane_size == 1 else f"{self.lane_size} ranks"
            lanes = f"; {self.lanes} lanes of {of}, each its own request, gathering in lockstep"
        return f"HSDP combined over {' x '.join(self._factors(short=True))}: {mesh}{lanes}"

    def __str__(self) -> str:
        return self.describe()

    # ----------------------------------------------------------------- conversions

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The settable fields, in declaration order (``world_size`` is derived, not one)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> DiffusionParallelConfig:
        """Build from a mapping of field names; every unknown key is an error, not ignored.

        A typo such as ``ulysess_degree`` would otherwise fall back to the default and run
        a different job than the one asked for.
        """
        if not isinstance(mapping, Mapping):
            raise TypeError(
                f"DiffusionParallelConfig.from_dict expects a mapping, got {type(mapping).__name__}"
            )
        accepted = cls.field_names()
        problems = []
        unknown = sorted((k for k in mapping if k not in accepted and k != "world_size"), key=str)
        if unknown:
            problems.append(
                "unknown key(s) "
                + ", ".join(repr(k) for k in unknown)
                + "; accepted keys: "
                + ", ".join(accepted)
            )
        if "world_size" in mapping:
            problems.append(
                "'world_size' is derived (pp * dp * tp * sp * cfg, or R * S for standalone HSDP) "
                "and cannot be set"
            )
        if problems:
            raise ValueError("DiffusionParallelConfig.from_dict: " + "; ".join(problems))
        return cls(**dict(mapping))

    def to_dict(self) -> dict[str, Any]:
        """The settable fields as given (a derived value stays ``None``/``-1``, "derive it");
        ``from_dict`` rebuilds an equal config, also after a degree in the dict is changed."""
        d = {name: getattr(self, name) for name in self.field_names()}
        d.update(getattr(self, "_given", {}))
        return d

    def replace(self, **changes: Any) -> DiffusionParallelConfig:
        """A new, validated config with ``changes`` applied to the values as given (unlike
        ``dataclasses.replace``, which would carry the resolved derived values over)."""
        return type(self).from_dict({**self.to_dict(), **changes})

    def to_hsdp_config(
        self,
        param_dtype: Any = "bfloat16",
        reduce_dtype: Any = "float32",
        output_dtype: Any = None,
        reshard_after_forward: bool = True,
        *,
        prefetch_depth: int = 1,
        max_unsharded_bytes: int | None = None,
        resident_bytes: int | str | None = None,
    ) -> Any:
        """The ``hsdp.HSDPInferenceConfig`` for ``apply_hsdp_to_model`` (its ``wire_dtype`` is
        ``hsdp_wire_dtype``); ``resident_bytes`` (None: this config's ``hsdp_resident_bytes``) is
        the residency budget."""
        if not self.use_hsdp:
            raise ValueError(
                "HSDP is not enabled (use_hsdp=False); set use_hsdp=True to build an "
                "HSDPInferenceConfig"
            )
        from hsdp._C import (
            HSDPInferenceConfig,
        )  # lazy: the config stays usable without the extension

        return HSDPInferenceConfig(
            enabled=True,
            hsdp_replicate_size=self.hsdp_replicate_size,
            hsdp_shard_size=self.hsdp_shard_size,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            output_dtype=output_dtype,
            reshard_after_forward=reshard_after_forward,
            prefetch_depth=prefetch_depth,
            max_unsharded_bytes=max_unsharded_bytes,
            wire_dtype=self.hsdp_wire_dtype,
            resident_bytes=self.hsdp_resident_bytes if resident_bytes is None else resident_bytes,
        )

    # ----------------------------------------------------------------- runtime checks

    def check_world(self, world_size: int | None = None) -> None:
        """Fail early, with the fix, when the job was launched with the wrong number of ranks."""
        if world_size is None:
            from hsdp.world.distributed import get_world_group  # lazy: needs a launched process group

            world_size = get_world_group().size
        launched = _as_positive_int("world_size", world_size)
        if launched != self.world_size:
            raise ValueError(
                f"this parallel config needs {self.world_size} ranks ({self.describe()}) but the "
                f"job was launched with {launched}; launch with "
                f"`python -m hsdp.launch -n {self.world_size} ...` "
                f"(or `mpiexec -n {self.world_size} ...`)"
            )

    def unsupported_degrees(self) -> list[str]:
        """The declared degrees the runtime does not execute yet, e.g. ``["ulysses_degree=4"]``
        (what ``hsdp.engine.built.PARALLEL_DEGREES`` lists as not built)."""
        return [item for items in built.not_built_degrees(self).values() for item in items]

    def require_supported(self) -> None:
        """Raise NotImplementedError naming every declared degree the runtime cannot run."""
        if self.use_hsdp:
            tail = "the HSDP mesh over these ranks works, but running the model with it does not"
        else:
            tail = "set these to 1 to run the model"
        built.require_degrees_built(self, tail)

    # ----------------------------------------------------------------- command line

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> DiffusionParallelConfig:
        """Build from a namespace parsed with :func:`add_parallel_args`.

        Dests missing from the namespace take the field default, so a parser that adds only
        some of the flags still works.
        """
        defaults = cls()
        kwargs: dict[str, Any] = {}
        for name in (
            "use_hsdp",
            "hsdp_shard_size",
            "hsdp_replicate_size",
            "hsdp_wire_dtype",
            "ulysses_degree",
            "ring_degree",
            "cfg_parallel_size",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "enable_expert_parallel",
            "hsdp_resident_bytes",
            "vae_patch_parallel_size",
        ):
            default = None if name == "data_parallel_size" else getattr(defaults, name)
            kwargs[name] = getattr(args, name, default)
        return cls(**kwargs)


def add_parallel_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the "parallelism" flags; ``DiffusionParallelConfig.from_cli_args`` reads them."""
    group = parser.add_argument_group(
        "parallelism",
        "How the job's ranks are used. The product of the parallel degrees is the number of "
        "ranks to launch; HSDP lays a (replicate, shard) mesh over them and adds none, except "
        "in standalone mode (all other degrees 1), where the world is replicate x shard.",
    )
    group.add_argument(
        "--use-hsdp",
        action="store_true",
        dest="use_hsdp",
        help="shard the transformer's weights across ranks (HSDP); each rank keeps 1/shard of them "
        "and gathers a block's full weights only while it computes. Cannot be combined with "
        "tensor or pipeline parallelism.",
    )
    group.add_argument(
        "--hsdp-shard-size",
        type=int,
        default=-1,
        dest="hsdp_shard_size",
        metavar="S",
        help="ranks that share one sharded copy of the weights. -1 (default) = auto: the product "
        "of the other parallel degrees divided by --hsdp-replicate-size; HSDP alone (no other "
        "parallelism) needs an explicit value.",
    )
    group.add_argument(
        "--hsdp-replicate-size",
        type=int,
        default=1,
        dest="hsdp_replicate_size",
        metavar="R",
        help="number of full sharded copies of the weights (default %(default)s); "
        "R x S ranks in all.",
    )
    group.add_argument(
        "--hsdp-wire-dtype",
        default=None,
        choices=WIRE_DTYPES,
        dest="hsdp_wire_dtype",
        help="hold and gather the sharded weights block-scaled in this float8 dtype (one float32 scale "
        "per 128 weights): about half the bytes of bfloat16 per gather and per rank, at e4m3's "
        "precision (see docs/performance.md). MPI and single-process only.",
    )
    group.add_argument(
        "--hsdp-resident-bytes",
        type=_cli_resident_bytes,
        default=None,
        dest="hsdp_resident_bytes",
        metavar="N|auto",
        help="per-rank budget of gathered weights kept across forwards (steps): after the first "
        "forward, up to N bytes of units (a K/M/G suffix is accepted) stay gathered and only the "
        "rest gather every step; 'auto' uses the free memory less a margin. Default: none, every "
        "unit gathers every step.",
    )
    group.add_argument(
        "--ulysses-degree",
        "--usp",
        type=int,
        default=1,
        dest="ulysses_degree",
        metavar="N",
        help="Ulysses sequence-parallel degree (default %(default)s); HSDP can overlay it.",
    )
    group.add_argument(
        "--ring-degree",
        type=int,
        default=1,
        dest="ring_degree",
        metavar="N",
        help="ring-attention sequence-parallel degree (default %(default)s); HSDP can overlay it.",
    )
    group.add_argument(
        "--cfg-parallel-size",
        type=int,
        default=1,
        dest="cfg_parallel_size",
        metavar="{1,2}",
        help="run the two classifier-free-guidance branches on 2 ranks (default %(default)s); "
        "HSDP can overlay it.",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        dest="tensor_parallel_size",
        metavar="N",
        help="tensor-parallel degree (default %(default)s); must be 1 with --use-hsdp.",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        dest="pipeline_parallel_size",
        metavar="N",
        help="pipeline-parallel degree (default %(default)s); must be 1 with --use-hsdp.",
    )
    group.add_argument(
        "--data-parallel-size",
        "--dp",
        type=int,
        default=None,
        dest="data_parallel_size",
        metavar="D",
        help="data-parallel degree (default: 1): D lanes, each running its own requests (a batch of "
        "prompts is spread over them); with --use-hsdp the weights stay sharded over all of them "
        "(shard size auto: world / replicate) and the lanes gather in lockstep.",
    )
    group.add_argument(
        "--vae-patch-parallel-size",
        type=int,
        default=1,
        dest="vae_patch_parallel_size",
        metavar="N",
        help="spread the tiles of the VAE's tiled decode (and image-to-video encode) over N ranks of each "
        "request (default %(default)s: one rank decodes); turns the VAE's tiling on. Adds no ranks.",
    )
    return group
