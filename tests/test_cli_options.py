"""The command line is generated from EngineConfig's fields: every option field has its flag, its type, and an
option left out leaves the field's default (no second list of options or defaults to keep in step)."""

from dataclasses import fields

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.cli_parser import ENGINE_OPTIONS, build_parser, engine_options


def test_every_engine_option_field_is_a_flag_of_serve() -> None:
    option_fields = {f.name for f in fields(EngineConfig) if "help" in f.metadata}
    assert set(ENGINE_OPTIONS) == option_fields and "block_size" in option_fields
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    dests = {action.dest for action in serve._actions}
    assert option_fields <= dests


def test_flags_parse_to_the_config_and_unset_ones_keep_its_defaults() -> None:
    args = build_parser().parse_args(
        ["serve", "--block-size", "8", "--no-enable-prefix-caching", "-tp", "2", "--collective-timeout", "3.5"]
    )
    options = engine_options(args)
    assert options == {
        "block_size": 8,
        "enable_prefix_caching": False,
        "tensor_parallel_size": 2,
        "collective_timeout_s": 3.5,
    }
    config = EngineConfig.from_options(options)
    assert (config.block_size, config.enable_prefix_caching, config.max_num_seqs) == (8, False, 64)
    assert EngineConfig.from_options(engine_options(build_parser().parse_args(["serve"]))) == EngineConfig()


def test_model_options_are_validated_once_and_the_command_line_defaults_to_auto() -> None:
    import pytest

    from tokenmill.config import ModelOptions
    from tokenmill.entrypoints.cli_parser import model_options
    from tokenmill.errors import InvalidParameterError

    assert model_options(build_parser().parse_args(["serve"])) == ModelOptions(None, "float32", "auto")
    args = build_parser().parse_args(["serve", "--model", "m.gguf", "--dtype", "bfloat16", "--quantization", "none"])
    assert model_options(args) == ModelOptions("m.gguf", "bfloat16", None)
    assert ModelOptions().quantization is None  # LLM(...)'s default: float weights
    with pytest.raises(InvalidParameterError) as bad:
        ModelOptions(dtype="float64")
    assert bad.value.param == "dtype"
    with pytest.raises(InvalidParameterError) as bad:
        ModelOptions(quantization="int3")
    assert bad.value.param == "quantization"
