"""Hugging Face checkpoint directories (config.json, safetensors, tokenizer.json): tiny random-weight Llama, Qwen2,
Qwen3 and Gemma 3 models written by HF transformers give HF's greedy tokens and log-probabilities; the bundled
SmolLM2 written as safetensors by transformers (from its GGUF) gives the GGUF's own float32 output; and what
cannot be loaded is refused with an error that names it, before any weight is read."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tests.hf_loading import fast_gguf_reading
from tests.test_engine import token_lists
from tests.test_golden import greedy
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.hf_checkpoint import HFCheckpoint
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

COMMON = dict(
    vocab_size=49152,  # the bundled model's tokenizer, written as tokenizer.json by the fixture below
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
TINY_CONFIGS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    # a 6-token window, global layer last, an attention scale that is not 1/sqrt(head_dim), rope bases per kind
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        ),
    ),
}


@pytest.fixture(scope="module")
def tokenizer_files(bundled_path: Path, tmp_path_factory) -> Path:
    """tokenizer.json and tokenizer_config.json of the bundled model (a byte-level BPE with a chat template)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    gguf = GGUFFile(bundled_path)
    Tokenizer.from_gguf(gguf).backend.save(str(folder / "tokenizer.json"))
    config = {"add_bos_token": False, "eos_token": "<|im_end|>", "chat_template": gguf.get("tokenizer.chat_template")}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_tiny(arch: str, folder: Path, tokenizer_files: Path, dtype: torch.dtype = torch.float32, **save) -> Path:
    """A tiny random-weight model of `arch` saved by transformers (biases and norms random too), with the
    tokenizer's files; returns its directory."""
    class_name, extra = TINY_CONFIGS[arch]
    config = getattr(transformers, class_name)(**COMMON, **extra)
    config.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]
    torch.manual_seed(sum(map(ord, arch)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name and arch != "gemma3" else 0.0  # Gemma's norms scale by 1 + w
            p.normal_(centre, 0.3 if "norm" in name else 0.1)
    model.to(dtype).save_pretrained(folder, **save)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def hf_reference(folder: Path, dtype: torch.dtype, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation of `prompt` and the log-probabilities at every position (prompt and output)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        ids = out[0].tolist()
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids[len(prompt) :], torch.log_softmax(logits, -1)


def check_against_hf(llm: LLM, folder: Path, dtype: torch.dtype, prompt: list[int], tolerance: float, n: int = 8):
    expected, hf_logprobs = hf_reference(folder, dtype, prompt, n)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    assert generated == expected
    # position i's log-probabilities are of the token after it: prompt positions 1.., then each generated token
    ours = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
    worst = 0.0
    for position, top in enumerate(ours):
        for token, lp in top.items():
            worst = max(worst, abs(lp.logprob - hf_logprobs[position, token].item()))
    assert worst < tolerance, worst
    return worst


PROMPT = list(range(1000, 1040))  # 40 tokens: several of Gemma's 6-token windows


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_tiny_float32_checkpoint_matches_hf(arch: str, tmp_path: Path, tokenizer_files: Path) -> None:
    folder = write_tiny(arch, tmp_path, tokenizer_files)
    llm = LLM(str(folder), max_num_batched_tokens=16)  # the prompt in chunks: windows crossing chunk edges
    assert llm.engine.model_config.architecture == arch
    check_against_hf(llm, folder, torch.float32, PROMPT, tolerance=1e-4)


@pytest.mark.slow
def test_float16_weights_computed_in_float32_match_hf(tmp_path: Path, tokenizer_files: Path) -> None:
    """float16 safetensors, upcast to float32 on both sides: the same numbers as a float32 checkpoint's."""
    folder = write_tiny("qwen3", tmp_path, tokenizer_files, dtype=torch.float16)
    assert "F16" in (folder / "model.safetensors").read_bytes()[:4096].decode("latin-1")
    check_against_hf(LLM(str(folder)), folder, torch.float32, PROMPT, tolerance=1e-4)


@pytest.mark.slow
def test_a_checkpoint_under_auto_decodes_natively(tmp_path: Path, tokenizer_files: Path) -> None:
    """`auto` quantizes a float checkpoint's projections to 4 bits at load for the native decoder, which gives
    the torch path's tokens on the same 4-bit weights (int4)."""
    folder = write_tiny("gemma3", tmp_path, tokenizer_files)
    assert LLM(str(folder), quantization="auto").engine.runner.decode_backend is not None
    int4 = LLM(str(folder), quantization="int4")
    assert int4.engine.runner.decode_backend is not None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:9]}]
    native = token_lists(int4.generate(prompts, params, use_tqdm=False))
    int4.engine.runner.decode_backend = None
    assert token_lists(int4.generate(prompts, params, use_tqdm=False)) == native


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_tiny_bfloat16_checkpoint_matches_hf(arch: str, tmp_path: Path, tokenizer_files: Path) -> None:
    """bfloat16 weights computed in bfloat16 on both sides: the roundings of two implementations differ, so the
    log-probabilities agree to 0.1 (measured: at most 0.047 for the four architectures; float32: 1e-4)."""
    folder = write_tiny(arch, tmp_path, tokenizer_files, dtype=torch.bfloat16)
    assert "BF16" in (folder / "model.safetensors").read_bytes()[:4096].decode("latin-1")
    llm = LLM(str(folder), dtype="bfloat16")
    check_against_hf(llm, folder, torch.bfloat16, PROMPT[:24], tolerance=0.1, n=4)


def test_sharded_checkpoint_and_its_tokenizer(tmp_path: Path, tokenizer_files: Path, bundled_path: Path) -> None:
    folder = write_tiny("llama", tmp_path, tokenizer_files, max_shard_size="2MB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 1
    llm = LLM(str(folder))
    ours, gguf = llm.get_tokenizer(), Tokenizer.from_gguf(GGUFFile(bundled_path))
    text = "Hello, world! <|im_start|>user\nnaïve café 🚀"
    assert ours.encode(text, add_special_tokens=True) == gguf.encode(text, add_special_tokens=True)
    assert ours.stop_token_ids >= {gguf.token_to_id("<|im_end|>")}
    prompt = llm.engine.chat_template.render([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_as_safetensors_gives_the_ggufs_output(llm: LLM, bundled_path: Path, tmp_path: Path, smollm2_reference):
    """transformers reads the GGUF (dequantized, Q/K rows unpermuted) and writes an HF directory: the same model in
    float32, so tokenmill's greedy output from it is the GGUF's, token for token (16 tokens here for CI's time;
    measured also for 32 on every reference prompt). Without a generation_config.json it samples with SmolLM2's
    recommended settings, found in its folder's name as in a user's download (not at temperature 1)."""
    from safetensors.torch import save_file

    with fast_gguf_reading():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            bundled_path.parent, gguf_file=bundled_path.name, dtype=torch.float32
        )
    tmp_path = tmp_path / "SmolLM2-135M-Instruct"
    tmp_path.mkdir()
    # written as save_pretrained writes it (transformers refuses to save a model it read from GGUF)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del weights["lm_head.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    del model, weights
    with fast_gguf_reading():
        tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_path.parent, gguf_file=bundled_path.name)
    tokenizer.save_pretrained(tmp_path)
    from_hf = LLM(str(tmp_path))
    assert not (tmp_path / "generation_config.json").exists()
    assert from_hf.engine.generation_defaults == llm.engine.generation_defaults  # SmolLM2's model card's
    gens = smollm2_reference["generations"]
    for g in gens:  # the tokenizer and chat template transformers wrote give the reference's prompt ids
        if g["kind"] == "chat":
            ids = from_hf.engine.encode_chat([{"role": "user", "content": g["prompt"]}])
        else:
            ids = from_hf.get_tokenizer().encode(g["prompt"], add_special_tokens=True)
        assert ids == g["prompt_ids"]
    prompts = [{"prompt_token_ids": g["prompt_ids"]} for g in gens]
    assert token_lists(from_hf.generate(prompts, greedy(16), use_tqdm=False)) == token_lists(
        llm.generate(prompts, greedy(16), use_tqdm=False)
    )


# ---- what cannot be loaded: refused, by name, before any weight is read -------------------------------------------


def test_unsupported_architecture_is_named(tmp_path: Path, tokenizer_files: Path) -> None:
    folder = write_tiny("llama", tmp_path, tokenizer_files)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["PhiForCausalLM"]}))
    supported = "supported: Gemma3ForCausalLM, GptOssForCausalLM, Llama"
    with pytest.raises(UnsupportedModelError, match=f"PhiForCausalLM.*{supported}"):
        LLM(str(folder))


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5}}, UnsupportedModelError, "longrope"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}, ModelFileError, "yarn' needs .*'factor'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, ModelFileError, "llama3' needs .*'factor'"),
        ({"mlp_bias": True}, UnsupportedModelError, "mlp_bias"),
        ({"num_key_value_heads": 3}, ModelFileError, "not a multiple of 3 KV heads"),
        ({"intermediate_size": 96}, ModelFileError, r"ffn_gate.weight is \(128, 64\), expected \(96, 64\)"),
        ({"hidden_size": None}, ModelFileError, "'hidden_size' is missing"),
    ],
)
def test_inconsistent_config_is_refused(change, error, message, tmp_path: Path, tokenizer_files: Path) -> None:
    folder = write_tiny("llama", tmp_path, tokenizer_files)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(error, match=message):
        LLM(str(folder))


def test_missing_and_corrupt_files_are_named(tmp_path: Path, tokenizer_files: Path) -> None:
    folder = write_tiny("qwen2", tmp_path, tokenizer_files)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ModelFileError, match="does not fit its byte range"):
        LLM(str(folder))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFileError, match=r"no \*.safetensors weights"):
        HFCheckpoint(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelFileError, match="tokenizer.json is missing"):
        LLM(str(folder))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match="directory without config.json"):
        LLM(str(tmp_path / "empty"))


def test_checkpoints_in_the_cache_are_listed(tmp_path: Path, tokenizer_files: Path, monkeypatch) -> None:
    from tokenmill.loader.catalog import list_models

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    (tmp_path / "models" / "tiny-qwen3").mkdir(parents=True)
    write_tiny("qwen3", tmp_path / "models" / "tiny-qwen3", tokenizer_files, dtype=torch.bfloat16)
    rows = [r for r in list_models() if r["path"] == str(tmp_path / "models" / "tiny-qwen3")]
    assert len(rows) == 1 and (rows[0]["architecture"], rows[0]["quantization"]) == ("qwen3", "BF16")
    assert rows[0]["parameters"] == "3M"  # 49,152 x 64 tied embeddings and three small layers


@pytest.mark.slow
def test_tensor_parallel_checkpoint_with_biases(tmp_path: Path, tokenizer_files: Path) -> None:
    """Qwen2's Q/K/V biases are cut with their rows over two ranks: the same greedy tokens as one process."""
    folder = write_tiny("qwen2", tmp_path, tokenizer_files)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[5:17]}]
    alone = token_lists(LLM(str(folder)).generate(prompts, params, use_tqdm=False))
    parallel = LLM(str(folder), tensor_parallel_size=2)
    try:
        assert token_lists(parallel.generate(prompts, params, use_tqdm=False)) == alone
    finally:
        parallel.close()


@pytest.mark.slow
@pytest.mark.server
def test_the_server_serves_a_checkpoint_directory(tmp_path: Path, tokenizer_files: Path) -> None:
    from openai import OpenAI

    from tests.server_utils import start_server

    folder = write_tiny("qwen3", tmp_path / "tiny-qwen3", tokenizer_files)
    server = start_server("--model", str(folder))
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].id == "tiny-qwen3"
        out = client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
        )
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()
