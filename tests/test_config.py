"""DiffusionParallelConfig: the validation matrix, conversions, CLI flags and runtime checks."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types

import pytest

from hsdp.engine.config import DiffusionParallelConfig, add_parallel_args

C = DiffusionParallelConfig


# ----------------------------------------------------------------------------- defaults


def test_defaults() -> None:
    c = C()
    assert c.pipeline_parallel_size == 1
    assert c.data_parallel_size == 1  # None means 1, resolved
    assert c.tensor_parallel_size == 1
    assert c.enable_expert_parallel is False
    assert c.sequence_parallel_size == 1
    assert (c.ulysses_degree, c.ring_degree, c.cfg_parallel_size) == (1, 1, 1)
    assert c.use_hsdp is False
    assert c.hsdp_shard_size == -1  # left as given while HSDP is off
    assert c.hsdp_replicate_size == 1
    assert c.world_size == 1
    assert c.hsdp_mode == "off"
    assert str(c) == "no HSDP: world 1"
    assert c.unsupported_degrees() == []
    c.require_supported()


def test_world_size_is_not_an_init_argument() -> None:
    with pytest.raises(TypeError):
        C(world_size=4)  # type: ignore[call-arg]


# ----------------------------------------------------------------------------- auto shard size


def test_auto_over_ulysses() -> None:
    c = C(use_hsdp=True, ulysses_degree=4)
    assert c.hsdp_shard_size == 4
    assert c.hsdp_replicate_size == 1
    assert c.sequence_parallel_size == 4
    assert c.world_size == 4
    assert c.hsdp_mode == "combined"
    assert str(c) == "HSDP combined over ulysses=4: replicate=1 x shard=4 (world 4)"


def test_auto_over_cfg_and_ulysses() -> None:
    c = C(use_hsdp=True, cfg_parallel_size=2, ulysses_degree=2)
    assert c.hsdp_shard_size == 4
    assert c.world_size == 4
    assert c.describe() == "HSDP combined over ulysses=2 x cfg=2: replicate=1 x shard=4 (world 4)"


def test_auto_over_ring() -> None:
    c = C(use_hsdp=True, ring_degree=2, ulysses_degree=2)
    assert c.sequence_parallel_size == 4
    assert c.hsdp_shard_size == 4
    assert c.world_size == 4


def test_auto_with_replicate_divides_world() -> None:
    c = C(use_hsdp=True, ulysses_degree=4, hsdp_replicate_size=2)
    assert c.hsdp_shard_size == 2
    assert c.world_size == 4
    assert str(c) == "HSDP combined over ulysses=4: replicate=2 x shard=2 (world 4)"


def test_auto_with_replicate_not_dividing_world() -> None:
    with pytest.raises(ValueError) as e:
        C(use_hsdp=True, ulysses_degree=4, hsdp_replicate_size=3)
    msg = str(e.value)
    assert "hsdp_replicate_size=3" in msg
    assert "4" in msg and "ulysses_degree=4" in msg
    assert "divide" in msg


def test_standalone_auto_is_an_error() -> None:
    with pytest.raises(ValueError) as e:
        C(use_hsdp=True)
    msg = str(e.value)
    assert "standalone" in msg
    assert "explicit hsdp_shard_size" in msg


def test_standalone_auto_with_replicate_is_an_error() -> None:
    with pytest.raises(ValueError, match="standalone"):
        C(use_hsdp=True, hsdp_replicate_size=2)


# ----------------------------------------------------------------------------- explicit shard size


def test_standalone_explicit_shard() -> None:
    c = C(use_hsdp=True, hsdp_shard_size=4)
    assert c.world_size == 4
    assert c.hsdp_mode == "standalone"
    assert str(c) == "HSDP standalone: replicate=1 x shard=4 (world 4)"


def test_standalone_replicate_and_shard() -> None:
    c = C(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2)
    assert c.world_size == 4
    assert (c.hsdp_replicate_size, c.hsdp_shard_size) == (2, 2)
    assert str(c) == "HSDP standalone: replicate=2 x shard=2 (world 4)"


def test_standalone_world_of_one() -> None:
    c = C(use_hsdp=True, hsdp_shard_size=1)
    assert c.world_size == 1


def test_combined_explicit_matching() -> None:
    c = C(
        use_hsdp=True,
        ulysses_degree=2,
        cfg_parallel_size=2,
        hsdp_shard_size=2,
        hsdp_replicate_size=2,
    )
    assert c.world_size == 4
    assert c.hsdp_mode == "combined"


def test_combined_mismatch_names_everything() -> None:
    with pytest.raises(ValueError) as e:
        C(
            use_hsdp=True,
            ulysses_degree=2,
            cfg_parallel_size=2,
            hsdp_shard_size=3,
            hsdp_replicate_size=2,
        )
    msg = str(e.value)
    assert "hsdp_replicate_size=2" in msg
    assert "hsdp_shard_size=3" in msg
    assert "= 6" in msg
    assert "world 4" in msg
    assert "ulysses_degree=2" in msg and "cfg_parallel_size=2" in msg


def test_combined_adds_no_ranks() -> None:
    # A shard size that would fit as standalone (S=4) is wrong on top of ulysses=2.
    with pytest.raises(ValueError, match="adds no ranks"):
        C(use_hsdp=True, ulysses_degree=2, hsdp_shard_size=4)


# ----------------------------------------------------------------------------- exclusivity


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"tensor_parallel_size": 2}, "tensor parallel (tensor_parallel_size=2)"),
        ({"pipeline_parallel_size": 2}, "pipeline parallel (pipeline_parallel_size=2)"),
        ({"enable_expert_parallel": True}, "expert parallel (enable_expert_parallel=True)"),
    ],
)
def test_hsdp_excludes_each(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        C(use_hsdp=True, hsdp_shard_size=2, **kwargs)
    msg = str(e.value)
    assert needle in msg
    # Only the conflict that applies is listed.
    others = {"tensor parallel (", "pipeline parallel (", "expert parallel ("}
    for other in others - {needle.split("(")[0] + "("}:
        assert other not in msg


def test_hsdp_excludes_all_in_one_message() -> None:
    with pytest.raises(ValueError) as e:
        C(
            use_hsdp=True,
            tensor_parallel_size=2,
            data_parallel_size=3,
            pipeline_parallel_size=4,
            enable_expert_parallel=True,
        )
    msg = str(e.value)
    for needle in (
        "tensor_parallel_size=2",
        "pipeline_parallel_size=4",
        "enable_expert_parallel=True",
    ):
        assert needle in msg
    assert "data_parallel_size" not in msg  # data parallel runs under HSDP (lanes)


def test_data_parallel_under_hsdp() -> None:
    """D lanes over the whole world; S derived from world / R spans the lanes; each lane lies
    in one shard group, or the config says why not."""
    c = C(use_hsdp=True, data_parallel_size=4)
    assert (c.world_size, c.hsdp_shard_size, c.lanes, c.lane_size) == (4, 4, 4, 1)
    assert "4 lanes of 1 rank" in c.describe()
    c = C(use_hsdp=True, data_parallel_size=2, cfg_parallel_size=2, ulysses_degree=2, hsdp_replicate_size=2)
    assert (c.world_size, c.hsdp_shard_size, c.lane_size) == (8, 4, 4)
    assert "dp=2 x ulysses=2 x cfg=2" in c.describe() and "2 lanes of 4 ranks" in c.describe()
    with pytest.raises(ValueError, match=r"each lane .* must lie inside one shard group.*multiple of 2"):
        C(use_hsdp=True, data_parallel_size=2, cfg_parallel_size=2, hsdp_replicate_size=4)
    with pytest.raises(ValueError, match="tensor parallel"):
        C(use_hsdp=True, data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(NotImplementedError, match="hsdp_resident_bytes='auto' with data_parallel_size=2"):
        C(use_hsdp=True, data_parallel_size=2, hsdp_resident_bytes="auto")
    assert C.from_cli_args(_parse(["--dp", "3", "--use-hsdp"])[0]) == C(use_hsdp=True, data_parallel_size=3)


def test_exclusivity_only_applies_with_hsdp() -> None:
    c = C(
        tensor_parallel_size=2,
        data_parallel_size=2,
        pipeline_parallel_size=2,
        enable_expert_parallel=True,
    )
    assert c.world_size == 8


# ----------------------------------------------------------------------------- bad values


DEGREES = [
    "pipeline_parallel_size",
    "data_parallel_size",
    "tensor_parallel_size",
    "ulysses_degree",
    "ring_degree",
    "cfg_parallel_size",
    "hsdp_replicate_size",
]


BAD_DEGREE_VALUES = [0, -2, True, False, 2.0, "2", None]


@pytest.mark.parametrize(
    "name, value",
    [
        (name, value)
        for name in DEGREES
        for value in BAD_DEGREE_VALUES
        if not (name == "data_parallel_size" and value is None)  # None means 1 there
    ],
)
def test_bad_degree(name: str, value: object) -> None:
    with pytest.raises(ValueError) as e:
        C(**{name: value})
    msg = str(e.value)
    assert name in msg
    assert repr(value) in msg or str(value) in msg


@pytest.mark.parametrize("value", [0, -2, True, 2.5, "4", None])
def test_bad_shard_size(value: object) -> None:
    with pytest.raises(ValueError) as e:
        C(use_hsdp=True, hsdp_shard_size=value)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "hsdp_shard_size" in msg and "-1" in msg
    assert repr(value) in msg


def test_bad_shard_size_checked_without_hsdp() -> None:
    with pytest.raises(ValueError, match="hsdp_shard_size"):
        C(hsdp_shard_size=0)


def test_bool_message_says_bool() -> None:
    with pytest.raises(
        ValueError, match=r"ulysses_degree must be a positive int, got True \(bool\)"
    ):
        C(ulysses_degree=True)


def test_numpy_style_integers_are_accepted() -> None:
    class Index:
        def __index__(self) -> int:
            return 2

    c = C(ulysses_degree=Index())  # type: ignore[arg-type]
    assert c.ulysses_degree == 2 and type(c.ulysses_degree) is int


@pytest.mark.parametrize("name", ["use_hsdp", "enable_expert_parallel"])
@pytest.mark.parametrize("value", [1, "true", None])
def test_flags_must_be_bool(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        C(**{name: value})


@pytest.mark.parametrize("value", [3, 4])
def test_cfg_is_one_or_two(value: int) -> None:
    with pytest.raises(ValueError) as e:
        C(cfg_parallel_size=value)
    msg = str(e.value)
    assert "cfg_parallel_size must be 1 or 2" in msg and str(value) in msg


def test_explicit_sequence_parallel_size_must_match() -> None:
    with pytest.raises(ValueError) as e:
        C(ulysses_degree=2, ring_degree=2, sequence_parallel_size=2)
    msg = str(e.value)
    assert "sequence_parallel_size=2" in msg
    assert "ulysses_degree=2" in msg
    assert "ring_degree=2" in msg
    assert "= 4" in msg


def test_explicit_sequence_parallel_size_matching() -> None:
    c = C(ulysses_degree=2, ring_degree=2, sequence_parallel_size=4)
    assert c.sequence_parallel_size == 4 and c.world_size == 4


@pytest.mark.parametrize("value", [0, True, "4"])
def test_explicit_sequence_parallel_size_bad(value: object) -> None:
    with pytest.raises(ValueError, match="sequence_parallel_size"):
        C(sequence_parallel_size=value)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- without HSDP


def test_no_hsdp_world_is_product() -> None:
    c = C(
        pipeline_parallel_size=2,
        data_parallel_size=3,
        tensor_parallel_size=5,
        ulysses_degree=7,
        ring_degree=11,
        cfg_parallel_size=2,
    )
    assert c.other_parallel_world == 2 * 3 * 5 * 7 * 11 * 2
    assert c.world_size == c.other_parallel_world
    assert c.hsdp_mode == "off"


def test_no_hsdp_leaves_hsdp_fields_as_given() -> None:
    c = C(hsdp_shard_size=3, hsdp_replicate_size=5, ulysses_degree=2)
    assert (c.hsdp_replicate_size, c.hsdp_shard_size) == (5, 3)
    assert c.world_size == 2


def test_no_hsdp_describe() -> None:
    assert str(C(cfg_parallel_size=2)) == "no HSDP: world 2 (cfg=2)"
    assert (
        str(C(tensor_parallel_size=2, enable_expert_parallel=True))
        == "no HSDP: world 2 (tp=2, expert parallel)"
    )


# ----------------------------------------------------------------------------- dict round trip


def test_from_dict_ok() -> None:
    c = C.from_dict({"use_hsdp": True, "ulysses_degree": 4, "hsdp_replicate_size": 2})
    assert c == C(use_hsdp=True, ulysses_degree=4, hsdp_replicate_size=2)
    assert c.hsdp_shard_size == 2


def test_from_dict_empty_is_default() -> None:
    assert C.from_dict({}) == C()


def test_from_dict_unknown_keys_all_named_sorted() -> None:
    with pytest.raises(ValueError) as e:
        C.from_dict({"ulysess_degree": 4, "use_hsdp": True, "abc": 1})
    msg = str(e.value)
    assert "'abc', 'ulysess_degree'" in msg
    # The accepted keys are listed so the typo is easy to fix.
    for name in C.field_names():
        assert name in msg


def test_from_dict_rejects_world_size() -> None:
    with pytest.raises(ValueError) as e:
        C.from_dict({"use_hsdp": True, "hsdp_shard_size": 4, "world_size": 4})
    assert "world_size" in str(e.value) and "derived" in str(e.value)


def test_from_dict_rejects_world_size_and_unknown_together() -> None:
    with pytest.raises(ValueError) as e:
        C.from_dict({"world_size": 4, "bogus": 1})
    msg = str(e.value)
    assert "'bogus'" in msg and "world_size" in msg


def test_from_dict_needs_a_mapping() -> None:
    with pytest.raises(TypeError):
        C.from_dict([("use_hsdp", True)])  # type: ignore[arg-type]


def test_from_dict_validates() -> None:
    with pytest.raises(ValueError, match="standalone"):
        C.from_dict({"use_hsdp": True})


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"use_hsdp": True, "hsdp_shard_size": 4},
        {"use_hsdp": True, "ulysses_degree": 4},
        {"use_hsdp": True, "ulysses_degree": 2, "cfg_parallel_size": 2, "hsdp_replicate_size": 2},
        {"tensor_parallel_size": 2, "data_parallel_size": 2, "enable_expert_parallel": True},
        {"hsdp_shard_size": 3, "hsdp_replicate_size": 2},
    ],
)
def test_to_dict_round_trip(kwargs: dict) -> None:
    c = C(**kwargs)
    d = c.to_dict()
    assert "world_size" not in d
    assert list(d) == list(C.field_names())
    again = C.from_dict(d)
    assert again == c
    assert again.world_size == c.world_size
    assert again.to_dict() == d


def test_replace_revalidates() -> None:
    c = C(use_hsdp=True, hsdp_shard_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        dataclasses.replace(c, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        c.replace(tensor_parallel_size=2)


def test_replace_rederives_what_was_derived() -> None:
    c = C(use_hsdp=True, ulysses_degree=4)  # auto shard size 4, sequence_parallel_size 4
    assert (c.hsdp_shard_size, c.sequence_parallel_size) == (4, 4)
    smaller = c.replace(ulysses_degree=2)
    assert (smaller.hsdp_shard_size, smaller.sequence_parallel_size, smaller.world_size) == (2, 2, 2)
    two = c.replace(hsdp_replicate_size=2)
    assert (two.hsdp_shard_size, two.world_size) == (2, 4)
    d = c.to_dict()
    assert d["hsdp_shard_size"] == -1 and d["sequence_parallel_size"] is None
    assert C.from_dict({**d, "ulysses_degree": 2}).hsdp_shard_size == 2
    explicit = C(use_hsdp=True, hsdp_shard_size=4)
    assert explicit.replace(hsdp_replicate_size=2).world_size == 8  # an explicit size is kept


# ----------------------------------------------------------------------------- command line


def _parse(argv: list[str]) -> tuple[argparse.Namespace, argparse._ArgumentGroup]:
    parser = argparse.ArgumentParser(prog="t")
    group = add_parallel_args(parser)
    return parser.parse_args(argv), group


def test_cli_defaults() -> None:
    args, group = _parse([])
    assert group.title == "parallelism"
    assert args.use_hsdp is False
    assert args.hsdp_shard_size == -1
    assert args.hsdp_replicate_size == 1
    assert args.ulysses_degree == 1
    assert args.ring_degree == 1
    assert args.cfg_parallel_size == 1
    assert args.tensor_parallel_size == 1
    assert args.pipeline_parallel_size == 1
    assert args.data_parallel_size is None
    assert C.from_cli_args(args) == C()


def test_cli_standalone() -> None:
    args, _ = _parse(["--use-hsdp", "--hsdp-shard-size", "4"])
    c = C.from_cli_args(args)
    assert c == C(use_hsdp=True, hsdp_shard_size=4)
    assert c.world_size == 4


@pytest.mark.parametrize("flag", ["--ulysses-degree", "--usp"])
def test_cli_ulysses_and_usp_alias(flag: str) -> None:
    args, _ = _parse(["--use-hsdp", flag, "4"])
    assert args.ulysses_degree == 4
    c = C.from_cli_args(args)
    assert c.hsdp_shard_size == 4 and c.world_size == 4 and c.hsdp_mode == "combined"


def test_cli_all_flags() -> None:
    args, _ = _parse(
        [
            "--ring-degree",
            "2",
            "--cfg-parallel-size",
            "2",
            "--tensor-parallel-size",
            "3",
            "--pipeline-parallel-size",
            "5",
            "--data-parallel-size",
            "7",
            "--hsdp-replicate-size",
            "11",
            "--hsdp-shard-size",
            "13",
        ]
    )
    c = C.from_cli_args(args)
    assert c == C(
        ring_degree=2,
        cfg_parallel_size=2,
        tensor_parallel_size=3,
        pipeline_parallel_size=5,
        data_parallel_size=7,
        hsdp_replicate_size=11,
        hsdp_shard_size=13,
    )
    assert c.world_size == 2 * 2 * 3 * 5 * 7


def test_cli_round_trip_through_flags() -> None:
    # Render a config back to flags and parse them: the same config comes out.
    c = C(use_hsdp=True, ulysses_degree=2, cfg_parallel_size=2, hsdp_replicate_size=2)
    argv = ["--use-hsdp"]
    for name in (
        "hsdp_shard_size",
        "hsdp_replicate_size",
        "ulysses_degree",
        "ring_degree",
        "cfg_parallel_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
    ):
        argv += ["--" + name.replace("_", "-"), str(getattr(c, name))]
    args, _ = _parse(argv)
    assert C.from_cli_args(args) == c


def test_cli_bad_value_reaches_config_validation() -> None:
    args, _ = _parse(["--use-hsdp"])
    with pytest.raises(ValueError, match="standalone"):
        C.from_cli_args(args)


def test_cli_partial_namespace_uses_defaults() -> None:
    c = C.from_cli_args(argparse.Namespace(use_hsdp=True, hsdp_shard_size=2))
    assert c == C(use_hsdp=True, hsdp_shard_size=2)


def test_cli_help_texts() -> None:
    parser = argparse.ArgumentParser(prog="t")
    add_parallel_args(parser)
    text = parser.format_help()
    assert "--usp" in text
    assert "-1" in text and "auto" in text
    for flag in (
        "--use-hsdp",
        "--hsdp-shard-size",
        "--hsdp-replicate-size",
        "--ulysses-degree",
        "--ring-degree",
        "--cfg-parallel-size",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--data-parallel-size",
    ):
        assert flag in text
    for action in parser._actions:
        if action.dest != "help":
            assert action.help, action.dest


# ----------------------------------------------------------------------------- check_world


def test_check_world_match() -> None:
    C(use_hsdp=True, hsdp_shard_size=4).check_world(4)
    C().check_world(1)


def test_check_world_mismatch() -> None:
    with pytest.raises(ValueError) as e:
        C(use_hsdp=True, hsdp_shard_size=4).check_world(2)
    msg = str(e.value)
    assert "needs 4 ranks" in msg
    assert "launched with 2" in msg
    assert "python -m hsdp.launch -n 4" in msg


@pytest.mark.parametrize("value", [0, True, "4"])
def test_check_world_bad_value(value: object) -> None:
    with pytest.raises(ValueError, match="world_size"):
        C().check_world(value)  # type: ignore[arg-type]


def test_check_world_uses_world_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand in for hsdp.distributed so this test needs no launched job.
    fake = types.ModuleType("hsdp.world.distributed")
    fake.get_world_group = lambda: types.SimpleNamespace(size=2)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hsdp.world.distributed", fake)
    C(cfg_parallel_size=2).check_world()
    with pytest.raises(ValueError, match="launched with 2"):
        C(use_hsdp=True, ulysses_degree=4).check_world()


# ----------------------------------------------------------------------------- supported degrees


def test_unsupported_degrees() -> None:
    assert C(use_hsdp=True, hsdp_shard_size=4).unsupported_degrees() == []
    assert C(use_hsdp=True, ulysses_degree=4).unsupported_degrees() == []  # Ulysses runs (hsdp.parallel)
    assert C(ulysses_degree=2, ring_degree=3, cfg_parallel_size=2).unsupported_degrees() == []  # ring runs too
    assert C(ring_degree=2, tensor_parallel_size=2).unsupported_degrees() == ["tensor_parallel_size=2"]


def test_unsupported_degrees_without_hsdp_include_other_parallelism() -> None:
    c = C(tensor_parallel_size=2, enable_expert_parallel=True)
    assert c.unsupported_degrees() == ["tensor_parallel_size=2", "enable_expert_parallel=True"]


def test_require_supported_ok() -> None:
    C(use_hsdp=True, hsdp_shard_size=4, hsdp_replicate_size=2).require_supported()


def test_require_supported_names_degree() -> None:
    C(use_hsdp=True, ulysses_degree=4, cfg_parallel_size=2).require_supported()  # both run
    C(use_hsdp=True, ulysses_degree=2, ring_degree=2, cfg_parallel_size=2).require_supported()  # USP runs
    with pytest.raises(NotImplementedError) as e:
        C(tensor_parallel_size=4).require_supported()
    assert str(e.value) == "tensor parallelism (tensor_parallel_size=4) is not built yet; set these to 1 to run the model"


def test_require_supported_names_all() -> None:
    with pytest.raises(NotImplementedError) as e:
        C(ring_degree=2, cfg_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2).require_supported()
    msg = str(e.value)
    assert "pipeline parallelism (pipeline_parallel_size=2)" in msg and "ring" not in msg
    assert "tensor parallelism (tensor_parallel_size=2)" in msg and "cfg_parallel_size" not in msg
    assert "are not built yet" in msg


# ----------------------------------------------------------------------------- to_hsdp_config


def test_to_hsdp_config_requires_hsdp() -> None:
    with pytest.raises(ValueError, match=r"HSDP is not enabled \(use_hsdp=False\)"):
        C(ulysses_degree=4).to_hsdp_config()


def test_to_hsdp_config_passes_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for the extension records what the config hands to C.
    seen: dict = {}

    def fake_config(**kwargs: object) -> dict:
        seen.update(kwargs)
        return kwargs

    # built first: a combined config asks the real core's mesh rule (hsdp._C.mesh_sizes)
    config = C(use_hsdp=True, cfg_parallel_size=2, ulysses_degree=2, hsdp_replicate_size=2,
               hsdp_wire_dtype="float8_e4m3fn")
    fake = types.ModuleType("hsdp._C")
    fake.HSDPInferenceConfig = fake_config  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hsdp._C", fake)
    config.to_hsdp_config(output_dtype="float16", reshard_after_forward=False, prefetch_depth=2)
    assert seen == {
        "enabled": True,
        "hsdp_replicate_size": 2,
        "hsdp_shard_size": 2,
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "output_dtype": "float16",
        "reshard_after_forward": False,
        "prefetch_depth": 2,
        "max_unsharded_bytes": None,
        "wire_dtype": "float8_e4m3fn",
        "resident_bytes": None,
    }


def test_to_hsdp_config() -> None:
    import hsdp._C  # noqa: F401  (needs the C core: a broken build fails, never skips)
    cfg = C(use_hsdp=True, ulysses_degree=4, hsdp_replicate_size=2).to_hsdp_config()
    assert cfg.enabled is True
    assert cfg.hsdp_replicate_size == 2
    assert cfg.hsdp_shard_size == 2
    assert cfg.param_dtype == "bfloat16"
    assert cfg.reduce_dtype == "float32"
    assert cfg.output_dtype is None
    assert cfg.reshard_after_forward is True


def test_to_hsdp_config_overrides() -> None:
    import hsdp._C  # noqa: F401  (needs the C core: a broken build fails, never skips)
    cfg = C(use_hsdp=True, hsdp_shard_size=4).to_hsdp_config(
        param_dtype="float32", output_dtype="float32", reshard_after_forward=False
    )
    assert cfg.hsdp_replicate_size == 1 and cfg.hsdp_shard_size == 4
    assert cfg.param_dtype == "float32"
    assert cfg.output_dtype == "float32"
    assert cfg.reshard_after_forward is False


# ----------------------------------------------------------------------------- purity


def test_module_imports_no_framework() -> None:
    # In a fresh interpreter: building configs (standalone, and combined, which asks the C
    # core's one mesh-size rule, hsdp._C.mesh_sizes) pulls in no framework.
    import subprocess

    code = (
        "import sys\n"
        "from hsdp.config import DiffusionParallelConfig\n"
        "DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2)\n"
        "DiffusionParallelConfig(use_hsdp=True, ulysses_degree=2)\n"
        "bad = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("text,value", [("auto", "auto"), ("AUTO", "auto"), ("4096", 4096), ("512M", 512 << 20),
                                        ("1.5G", 3 << 29), ("2g", 2 << 30), ("64KiB", 64 << 10)])
def test_cli_resident_bytes(text: str, value: object) -> None:
    args, _ = _parse(["--use-hsdp", "--hsdp-shard-size", "2", "--hsdp-resident-bytes", text])
    c = C.from_cli_args(args)
    assert c.hsdp_resident_bytes == value
    assert c.to_hsdp_config().resident_bytes == value
    assert c.to_hsdp_config(resident_bytes=7).resident_bytes == 7
    assert C(use_hsdp=True, hsdp_shard_size=2, hsdp_resident_bytes=text) == c
    assert C.from_dict(c.to_dict()) == c


def test_cli_resident_bytes_refuses_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--hsdp-resident-bytes", "12Q"])
    assert "--hsdp-resident-bytes: resident bytes must be a byte count" in capsys.readouterr().err
    assert _parse([])[0].hsdp_resident_bytes is None
    for bad in (-1, True, 1.5, "lots"):
        with pytest.raises(ValueError, match="hsdp_resident_bytes"):
            C(hsdp_resident_bytes=bad)
