"""LoRA test material: a tiny random Llama written by transformers (tests/test_hf_checkpoints.py's), adapters made
on it by PEFT with random A and B, and transformers' greedy tokens with an adapter merged into the weights."""

import json
from pathlib import Path

import torch
import transformers

from tests.test_hf_checkpoints import write_tiny
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = list(range(1000, 1040))  # 40 tokens: more than two 16-token KV blocks
# four adapters that differ in rank, scale and targets (rsLoRA among them)
ADAPTERS = {
    "all8": dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS),
    "attn4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp16": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "qv8rs": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


def write_tiny_llama(folder: Path, bundled_path: Path) -> Path:
    """The tiny random Llama with the bundled model's tokenizer (tokenizer.json and its config)."""
    tokenizer = folder / "tokenizer"
    tokenizer.mkdir(parents=True)
    gguf = GGUFFile(bundled_path)
    Tokenizer.from_gguf(gguf).backend.save(str(tokenizer / "tokenizer.json"))
    config = {"add_bos_token": False, "eos_token": "<|im_end|>", "chat_template": gguf.get("tokenizer.chat_template")}
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    base = folder / "base"
    base.mkdir()
    return write_tiny("llama", base, tokenizer)


def write_adapter(base: Path, folder: Path, seed: int, **lora_config) -> Path:
    """A PEFT LoRA adapter on `base` with random A and B (PEFT's own start has B = 0: no change), saved as PEFT
    saves one (adapter_config.json, adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(folder)
    return folder


def merged_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens (float32) with the adapter merged into the weights (None: the base model)."""
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()
