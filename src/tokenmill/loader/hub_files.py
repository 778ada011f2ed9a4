"""Which files of a Hub repository make the model a reference asks for: the GGUF file a quant tag or `--hf-file`
picks (with all its shards, `-00001-of-0000N`), or a safetensors checkpoint's files. Works on the repo's file list
only (no network), so it chooses the same way online and from the cache."""

import re
from collections.abc import Iterable

from tokenmill.errors import ModelFileError
from tokenmill.loader.gguf_file import SHARD_NAME as SHARD
from tokenmill.loader.hub_reference import HubReference

# a quant as GGUF file names spell it: Q4_K_M, Q8_0, IQ4_XS, Q4_0_4_4, F16, BF16, ...
QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Za-z0-9]+)*|B?F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf (and the Hub) pick when a GGUF repo is named without a tag

# a safetensors checkpoint: its weights, config, tokenizer and generation config, nothing in subfolders (Meta's
# original/ weights) and no consolidated copy of the shards (Mistral's repos carry both)
SAFETENSORS_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "*.jinja", "*.txt"]
SAFETENSORS_IGNORED = ["*/*", "consolidated*"]


def quant_of(filename: str) -> str | None:
    """The quant a GGUF file name states (the last one: "Llama-3.2-1B-Q4_K_M.gguf" -> "Q4_K_M"), upper-case."""
    found = QUANT.findall(SHARD.sub(lambda m: m["base"], filename.rsplit("/", 1)[-1]))
    return found[-1].upper() if found else None


def is_safetensors_repo(files: Iterable[str]) -> bool:
    names = set(files)
    return "config.json" in names and any(f.endswith(".safetensors") and "/" not in f for f in names)


def gguf_models(files: Iterable[str]) -> dict[str, list[str]]:
    """The repo's GGUF models (multimodal projectors left out): first file -> all its files (shards in order)."""
    groups: dict[str, list[str]] = {}
    for f in sorted(files):
        name = f.rsplit("/", 1)[-1]
        if not name.lower().endswith(".gguf") or name.lower().startswith("mmproj"):
            continue
        shard = SHARD.fullmatch(f)
        key = f"{shard['base']}-of-{shard['count']}" if shard else f
        groups.setdefault(key, []).append(f)
    return {files_[0]: files_ for files_ in groups.values()}


def pick_gguf(ref: HubReference, files: list[str]) -> list[str]:
    """The files of the GGUF model `ref` asks for (one, or every shard of a split model, first shard first)."""
    if ref.hf_file is not None:
        if ref.hf_file not in files:
            raise ModelFileError(f"{ref.repo_id} has no file {ref.hf_file!r}; {_what_it_has(ref.repo_id, files)}")
        shard = SHARD.fullmatch(ref.hf_file)
        if shard is None:
            return [ref.hf_file]
        return _all_shards(ref, next(group for group in gguf_models(files).values() if ref.hf_file in group))
    models = gguf_models(files)
    if not models:
        raise ModelFileError(f"{ref.repo_id} has no .gguf files; {_what_it_has(ref.repo_id, files)}")
    if ref.tag is None:
        if len(models) == 1:
            return _all_shards(ref, next(iter(models.values())))
        chosen = _matching(models, DEFAULT_QUANT)
        if len(chosen) == 1:
            return _all_shards(ref, chosen[0])
        raise ModelFileError(
            f"{ref.repo_id} has {len(models)} GGUF files: pick one with {ref.repo_id}:QUANT "
            f"({', '.join(_quants(models))}) or --hf-file FILE ({', '.join(models)})"
        )
    chosen = _matching(models, ref.tag)
    if len(chosen) == 1:
        return _all_shards(ref, chosen[0])
    if not chosen:
        raise ModelFileError(
            f"{ref.repo_id} has no GGUF file for {ref.tag!r}: its quants are {', '.join(_quants(models))} "
            f"(files: {', '.join(models)})"
        )
    raise ModelFileError(
        f"{ref.repo_id}:{ref.tag} names {len(chosen)} GGUF files ({', '.join(g[0] for g in chosen)}): give a longer "
        "quant or --hf-file FILE"
    )


def _matching(models: dict[str, list[str]], tag: str) -> list[list[str]]:
    """The models whose file name holds `tag` (case-insensitive); where several do, those that hold it as a whole
    quant ("Q4_0" picks ...-Q4_0.gguf over ...-Q4_0_4_4.gguf)."""
    holding = [g for first, g in models.items() if tag.lower() in first.rsplit("/", 1)[-1].lower()]
    whole = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
    exact = [g for g in holding if whole.search(SHARD.sub(lambda m: m["base"], g[0].rsplit("/", 1)[-1]))]
    return exact if len(holding) > 1 and exact else holding


def _all_shards(ref: HubReference, group: list[str]) -> list[str]:
    shard = SHARD.fullmatch(group[0])
    if shard is None:
        return group
    count = int(shard["count"])
    if len(group) != count or int(shard["index"]) != 1:
        raise ModelFileError(f"{ref.repo_id}: the split GGUF {group[0]} has {len(group)} of its {count} shards")
    return group


def _quants(models: dict[str, list[str]]) -> list[str]:
    return sorted({quant_of(first) or first for first in models})


def _what_it_has(repo_id: str, files: list[str]) -> str:
    models = gguf_models(files)
    if models:
        return f"its GGUF quants: {', '.join(_quants(models))} (files: {', '.join(models)})"
    shown = ", ".join(files[:20]) + (", ..." if len(files) > 20 else "")
    return f"its files: {shown or 'none'}"
