"""The model's recommended sampling settings: where they are read from, and that every entry point uses them for
what a request leaves unset (and only that)."""

import json
from types import SimpleNamespace

import pytest

from tokenmill.errors import InvalidParameterError
from tokenmill.model.generation_defaults import FALLBACK, GenerationDefaults, read_generation_defaults
from tokenmill.server.protocol import CompletionRequest


def gguf(metadata: dict) -> SimpleNamespace:
    return SimpleNamespace(metadata=metadata, get=metadata.get)


def checkpoint(generation_config: dict | None, model_type: str = "llama", path: str = "/models/x", **config):
    return SimpleNamespace(generation_config=generation_config, config={"model_type": model_type, **config}, path=path)


def test_a_checkpoints_generation_config_wins_and_bad_values_are_left_out(caplog) -> None:
    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300, "repetition_penalty": -1}
    found = read_generation_defaults(checkpoint(config, "gemma3_text"))
    assert found.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    assert found.max_tokens == 300 and "max_tokens" not in found.sampling_values()
    assert "repetition_penalty=-1" in caplog.text  # logged, not fatal
    # nothing about sampling in it: the family's recommendation, else llama.cpp's defaults (never plain temperature 1)
    assert read_generation_defaults(checkpoint({"bos_token_id": 1}, "gemma3_text")).values["top_k"] == 64
    assert read_generation_defaults(checkpoint(None, "qwen2")).values == FALLBACK[0]


def test_a_checkpoints_family_is_found_in_its_names() -> None:
    """SmolLM2's model_type is llama: its family is in its folder's name, a download's repository name or
    config.json's _name_or_path (SmolLM2's own generation_config.json names no sampling settings)."""
    smollm2 = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
    no_sampling = {"bos_token_id": 1, "eos_token_id": 2}
    assert read_generation_defaults(checkpoint(no_sampling, path="/m/SmolLM2-135M-Instruct")).values == smollm2
    download = "/hf/hub/models--HuggingFaceTB--SmolLM2-360M-Instruct/snapshots/12ab"
    assert read_generation_defaults(checkpoint(None, path=download)).values == smollm2
    named = checkpoint(None, path="/m/mine", _name_or_path="HuggingFaceTB/SmolLM2-1.7B-Instruct")
    assert read_generation_defaults(named).values == smollm2
    found = read_generation_defaults(checkpoint(None, path="/m/my-llama"))
    assert (found.values, found.source) == (FALLBACK[0], "llama.cpp's defaults")


def test_gguf_metadata_then_family_then_llama_cpp_defaults() -> None:
    own = gguf({"general.basename": "smollm2", "general.sampling.temp": 0.5, "general.sampling.top_k": 5})
    assert read_generation_defaults(own).values == {"temperature": 0.5, "top_k": 5}
    assert read_generation_defaults(gguf({"general.basename": "gemma-3"})).values == {
        "temperature": 1.0,
        "top_k": 64,
        "top_p": 0.95,
    }
    assert read_generation_defaults(gguf({"general.basename": "mystery"})).values == FALLBACK[0]


def test_the_bundled_model_reads_well_by_default(bundled_path) -> None:
    from tokenmill.loader.gguf_file import GGUFFile

    found = read_generation_defaults(GGUFFile(bundled_path))
    assert found.values == {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
    assert "SmolLM2" in found.source


def test_modes_tokenmill_and_a_file(tmp_path) -> None:
    source = gguf({"general.basename": "smollm2"})
    assert read_generation_defaults(source, "tokenmill").values == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0, "max_new_tokens": 5}))
    for where in (tmp_path, tmp_path / "generation_config.json"):
        assert read_generation_defaults(source, str(where)).values == {"temperature": 0, "max_tokens": 5}
    with pytest.raises(InvalidParameterError, match="generation_config"):
        read_generation_defaults(source, str(tmp_path / "missing.json"))


def test_a_request_keeps_what_it_names_and_takes_the_rest() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
    req = CompletionRequest(prompt="hi", temperature=0.0, top_k=3)
    params = req.sampling_params(defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.0, 0.9, 3, 1.1)
    plain = CompletionRequest(prompt="hi").sampling_params()
    assert (plain.temperature, plain.top_p, plain.repetition_penalty) == (1.0, 1.0, 1.0)


def test_llm_uses_the_models_settings_without_sampling_params(llm) -> None:
    from tokenmill import SamplingParams

    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.repetition_penalty) == (0.2, 0.9, 1.1)
    assert llm.get_default_sampling_params(max_tokens=3, temperature=0).temperature == 0
    # top_k=1 makes the recommended settings greedy: the default call must then give their greedy tokens, which
    # differ from plain greedy's only through the repetition penalty the defaults carry
    prompt = "The the the the the the"
    with_defaults = llm.generate(prompt, llm.get_default_sampling_params(top_k=1, max_tokens=12), use_tqdm=False)
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert with_defaults[0].outputs[0].token_ids != plain[0].outputs[0].token_ids
    # no sampling params: the engine's defaults, whatever they are (here replaced by greedy, 4 tokens)
    saved = llm.engine.generation_defaults
    llm.engine.generation_defaults = GenerationDefaults({"temperature": 0, "max_tokens": 4}, "a test")
    try:
        assert llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids[:4]
        chat = [{"role": "user", "content": "Hi"}]
        assert len(llm.chat(chat)[0].outputs[0].token_ids) <= 4
    finally:
        llm.engine.generation_defaults = saved


def test_the_servers_output_length_order() -> None:
    """asked, else --max-tokens-default, else the model's max_new_tokens, else the API's; --max-tokens-limit caps."""
    from tokenmill.server.neutral_request import OutputLength
    from tokenmill.server.state import ServerSettings, ServerState

    def limit(asked, api_default, **settings) -> int | None:
        state = ServerState(ServerSettings(**settings))
        max_tokens = GenerationDefaults({"max_tokens": 7}, "a test").max_tokens
        state.model = SimpleNamespace(default_max_tokens=max_tokens, max_model_len=2048)
        return state.output_limits().settle(OutputLength(asked, api_default))

    assert limit(None, 16) == 7 and limit(3, 16) == 3
    assert limit(None, 16, max_tokens_default=5) == 5
    assert limit(None, None, max_tokens_limit=6, max_tokens_default=9) == 6
