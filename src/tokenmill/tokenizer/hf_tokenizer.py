"""The tokenizer of a Hugging Face checkpoint: its `tokenizer.json` (the fast tokenizer's own file, loaded by the
`tokenizers` package as it is), with BOS/EOS and the tokens that end generation from `tokenizer_config.json`,
`generation_config.json` and `config.json`."""

from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from tokenmill.errors import ModelFileError
from tokenmill.loader.hf_checkpoint import TOKENIZER_FILE, HFCheckpoint
from tokenmill.tokenizer.gguf_tokenizer import END_OF_TURN, Tokenizer


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json names a token as a string or as an AddedToken-like {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def tokenizer_from_checkpoint(checkpoint: HFCheckpoint) -> Tokenizer:
    path = checkpoint.path / TOKENIZER_FILE
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the tokenizers package raises its own Exception types
        raise ModelFileError(f"{path}: not a tokenizer file the tokenizers package can read: {exc}") from exc
    tok_cfg, gen_cfg, cfg = checkpoint.tokenizer_config, checkpoint.generation_config, checkpoint.config

    def token_id(key: str) -> int | None:
        text = _token_text(tok_cfg.get(key))
        found = backend.token_to_id(text) if text is not None else None
        if found is not None:
            return found
        ids = _ids(gen_cfg.get(f"{key}_id", cfg.get(f"{key}_id")))
        return ids[0] if ids else None

    bos, eos = token_id("bos_token"), token_id("eos_token")
    stop = set(_ids(gen_cfg.get("eos_token_id"))) | set(_ids(cfg.get("eos_token_id")))
    stop.update(i for t in END_OF_TURN if (i := backend.token_to_id(t)) is not None)
    # BOS as the checkpoint's tokenizer adds it: tokenizer_config's add_bos_token, else what the file's own
    # post-processor does with an empty text (tokenmill adds special tokens itself, not through the backend)
    add_bos = tok_cfg.get("add_bos_token")
    if add_bos is None:
        add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
    byte_level = isinstance(backend.decoder, decoders.ByteLevel)
    pieces = backend.get_vocab(with_added_tokens=True)
    byte_tokens = sum(1 for p in pieces if len(p) == 6 and p.startswith("<0x") and p.endswith(">"))
    bounded = byte_level or byte_tokens >= 256  # otherwise an unknown token may stand for any length of text
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_id=eos,
        add_bos=bool(add_bos),
        add_eos=bool(tok_cfg.get("add_eos_token", False)),
        eos_token_ids=frozenset(stop),
        kind="gpt2" if byte_level else "llama",
        max_token_chars=max(map(len, pieces), default=1) if bounded else None,
    )
