"""The command line is generated from EngineConfig's fields (and `tokenmill serve`'s own from ServerSettings'):
every option field has its flag, its type, and an option left out leaves the field's default (no second list of
options or defaults to keep in step)."""

from dataclasses import fields

import pytest

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


def serve_parser():
    return build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]


def test_every_server_settings_field_is_a_flag_of_serve_or_filled_from_other_options() -> None:
    """ServerSettings declares the server's options once (config/server.py): each field is a flag of `tokenmill
    serve` generated from it, or says which other options fill it (the model's and the engine's). And serve has no
    flag besides those, the model's, the engine's and --help: an option written by hand, in the parser or in a
    second list of fields, fails here."""
    from tokenmill.config import ModelOptions
    from tokenmill.config.server import ServerSettings
    from tokenmill.entrypoints.cli_parser import SERVER_OPTIONS

    flags = {f.name for f in fields(ServerSettings) if "help" in f.metadata}
    filled = {f.name for f in fields(ServerSettings) if "filled_by" in f.metadata}
    assert not flags & filled
    assert flags | filled == {f.name for f in fields(ServerSettings)}  # every field is one or the other
    # the model's and the engine's options, and what serve's own flags fill beside their fields
    assert filled == {f.name for f in fields(ModelOptions)} | {
        "engine_options",
        "served_model_aliases",
        "chat_template",
    }
    assert set(SERVER_OPTIONS) == flags and {"host", "port", "api_key", "slots_endpoint", "log_level"} <= flags
    dests = {action.dest for action in serve_parser()._actions}
    model = {f.name for f in fields(ModelOptions)} | {"device", "verbose"}
    # beside --help, the one argument that is no field: `serve MODEL`, vLLM's spelling of --model
    assert dests == flags | model | set(ENGINE_OPTIONS) | {"help", "model_positional"}


def test_server_flags_parse_to_the_settings_and_unset_ones_keep_its_defaults() -> None:
    from tokenmill.config.server import DEFAULT_MAX_REQUEST_BYTES, ServerSettings
    from tokenmill.entrypoints.cli_parser import server_settings

    assert server_settings(build_parser().parse_args(["serve"])) == ServerSettings()
    assert ServerSettings().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES and ServerSettings().explorer
    args = build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--port", "9001", "--shutdown-grace", "2.5", "--max-request-bytes", "0"]
        + ["--no-explorer", "--allowed-origins", "http://a, http://b,", "--allowed-hosts", "*", "--no-slots"]
        + ["--access-log", "--disable-log-requests", "--log-stats-interval", "0", "--log-level", "debug"]
        + ["--block-size", "8", "--model", "m.gguf"]
    )
    s = server_settings(args)
    assert (s.host, s.port, s.shutdown_grace_s, s.max_request_bytes) == ("0.0.0.0", 9001, 2.5, None)  # 0: no limit
    assert (s.explorer, s.slots_endpoint, s.log_requests, s.access_log) == (False, False, False, True)
    assert (s.allowed_origins, s.allowed_hosts) == (["http://a", "http://b"], ["*"])
    assert (s.log_stats_interval_s, s.log_level) == (None, "debug")  # 0: no throughput lines
    # the model's and the engine's options are theirs: the caller fills those fields
    assert (s.model, s.engine_options) == (None, {})
    # switches one way only keep their help's spelling; the others are --x / --no-x
    options = {o for action in serve_parser()._actions for o in action.option_strings}
    assert {"--no-explorer", "--disable-log-requests", "--slots", "--no-slots", "--shutdown-grace"} <= options
    assert not {"--explorer", "--log-requests", "--no-access-log", "--slots-endpoint"} & options


def test_serve_takes_the_model_as_its_argument_as_vllm_serve_does() -> None:
    from tokenmill.entrypoints.cli_parser import model_options, settle_model_argument

    parser = build_parser()
    for argv in (["serve", "org/name"], ["serve", "org/name", "--model", "org/name"], ["serve", "--model", "org/name"]):
        args = parser.parse_args(argv)
        settle_model_argument(parser, args)
        assert model_options(args).model == "org/name"
    args = parser.parse_args(["serve", "org/one", "--model", "org/two"])
    with pytest.raises(SystemExit):
        settle_model_argument(parser, args)
