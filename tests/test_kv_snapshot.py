"""A prefix's K/V saved to a file and restored into the prefix cache (engine/kv_snapshot.py: llama.cpp's slot save
and restore): another engine of the same model reads the restored blocks instead of computing them and answers the
same tokens; the file is llama.cpp's sequence state layout with tokenmill's K/V section after the tokens."""

import struct
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.kv_snapshot import (
    STATE_MAGIC,
    PrefixFile,
    decode_file,
    encode_file,
    restore_prefix,
    save_prefix,
)
from tokenmill.errors import InvalidParameterError

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg built a machine "
    "with movable type in Mainz, and it changed how people"
)


def forget_everything(llm: LLM) -> None:
    for pool in llm.engine.kv.pools:
        pool.reset_prefix_cache()


def saved_run(llm: LLM, prompt: str) -> tuple[list[int], str, bytes]:
    """Run the prompt, then save what the cache holds of its tokens: (tokens, text, the file's bytes)."""
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    tokens = out.prompt_token_ids + out.outputs[0].token_ids[:-1]  # what a slot holds: the last token uncomputed
    return tokens, out.outputs[0].text, encode_file(save_prefix(llm.engine, tokens))


def test_restored_blocks_are_read_by_another_engine_and_give_the_same_tokens(llm: LLM) -> None:
    tokens, text, data = saved_run(llm, PROMPT)
    snapshot = decode_file(data)
    bs = llm.engine.config.block_size
    assert snapshot.tokens == tokens and snapshot.num_blocks == len(tokens) // bs
    other = LLM()  # another engine (as another process would be): its cache starts empty
    assert restore_prefix(other.engine, snapshot) == snapshot.num_blocks * bs
    other.engine.check_integrity()
    again = other.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    n_prompt = len(again.prompt_token_ids)
    assert again.num_cached_tokens == (n_prompt - 1) // bs * bs > 0  # read back, not computed
    assert again.outputs[0].text == text
    assert restore_prefix(other.engine, snapshot) == snapshot.num_blocks * bs  # cached already: reused
    other.engine.check_integrity()


def test_restore_after_the_cache_forgot_the_prefix(llm: LLM) -> None:
    prompt = PROMPT.replace("Mainz", "Strasbourg")
    tokens, text, data = saved_run(llm, prompt)
    forget_everything(llm)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    forget_everything(llm)
    restore_prefix(llm.engine, decode_file(data))
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].text == text


def test_the_file_is_llamacpps_layout_and_its_plain_token_list_reads_too(llm: LLM) -> None:
    """magic "ggsq", version 3, the packed slot tokens [-1, 1, n, tokens..., 0]; the same file with the tokens
    rewritten as a plain list (as older llama-servers wrote them) restores the same K/V."""
    tokens, _, data = saved_run(llm, PROMPT)
    magic, version, n_words = struct.unpack_from("<III", data)
    assert (magic, version, n_words) == (STATE_MAGIC, 3, len(tokens) + 4)
    words = list(struct.unpack_from(f"<{n_words}i", data, 12))
    assert words == [-1, 1, len(tokens), *tokens, 0]
    rest = data[12 + 4 * n_words :]
    legacy = struct.pack(f"<III{len(tokens)}i", magic, version, len(tokens), *tokens) + rest
    snapshot = decode_file(legacy)
    assert snapshot.tokens == tokens and snapshot.num_blocks > 0
    forget_everything(llm)
    assert restore_prefix(llm.engine, snapshot) > 0


def test_files_it_cannot_take_are_refused_and_leave_the_cache_as_it_was(llm: LLM, tmp_path: Path) -> None:
    tokens, _, data = saved_run(llm, PROMPT)
    snapshot = decode_file(data)
    usage = llm.engine.kv.usage()
    other_layout = PrefixFile(tokens, {**snapshot.layout, "block_size": 32}, snapshot.num_blocks, 0, snapshot.tensors)
    with pytest.raises(InvalidParameterError, match="block_size"):
        restore_prefix(llm.engine, other_layout)
    with pytest.raises(InvalidParameterError, match="no K/V"):  # llama.cpp's own file: its tokens, not our K/V
        restore_prefix(llm.engine, decode_file(data[: 12 + 4 * (len(tokens) + 4)]))
    bad_tokens = PrefixFile([10**7, *tokens[1:]], snapshot.layout, snapshot.num_blocks, 0, snapshot.tensors)
    with pytest.raises(InvalidParameterError, match="Invalid tokens"):
        restore_prefix(llm.engine, bad_tokens)
    short = dict(snapshot.tensors)
    short["k.0"] = short["k.0"][:-1]
    with pytest.raises(InvalidParameterError, match="k.0"):
        restore_prefix(llm.engine, PrefixFile(tokens, snapshot.layout, snapshot.num_blocks, 0, short))
    for bad in (b"", b"GGUF" + data[4:], data[:20], data[: 12 + 4 * len(tokens)] + b"TMKV\x01\x00\x00\x00junk"):
        with pytest.raises(InvalidParameterError):
            decode_file(bad)
    media = struct.pack("<III6i", STATE_MAGIC, 3, 6, -1, 1, 1, 5, 1, 0)  # one token, one media chunk
    with pytest.raises(InvalidParameterError, match="media"):
        decode_file(media)
    assert llm.engine.kv.usage() == usage
    llm.engine.check_integrity()


@pytest.mark.slow
def test_gemma3_restores_both_pools(gemma3_path: Path) -> None:
    """Gemma 3's sliding-window layers keep their own pool: a prefix longer than the window saves the full pool's
    blocks and the window pool's last ones, and both come back."""
    gemma = LLM(str(gemma3_path), max_num_batched_tokens=256)
    prompt = PROMPT * 20  # about 600 tokens: beyond the 512-token window
    tokens, text, data = saved_run(gemma, prompt)
    snapshot = decode_file(data)
    assert snapshot.window_first > 0 and snapshot.num_blocks == len(tokens) // 16
    forget_everything(gemma)
    restore_prefix(gemma.engine, snapshot)
    gemma.engine.check_integrity()
    again = gemma.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16
    assert again.outputs[0].text == text
