"""llama.cpp's prompt shapes as token ids, read as llama-server reads them (tokenize_mixed, tokenize_input_prompts):

- "text", or {"prompt_string": "text"}: one prompt, BOS added as the model wants;
- [ids and texts mixed]: one prompt; a text first in the list gets BOS, later ones none; ids are taken as they are;
- any other list ([[ids], "text", {...}]): a batch, one prompt per element, each read as above.

Also the logit_bias shapes ([[id or text, bias]], {id or text: bias}; a text biases each of its tokens; false bans)."""

from typing import Any

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import MAX_LOGIT_BIAS
from tokenmill.tokenizer import Tokenizer

PROMPT_STRING_KEY = "prompt_string"
MULTIMODAL_KEY = "multimodal_data"
BAN = -MAX_LOGIT_BIAS  # llama.cpp's -inf bias (false, ignore_eos): e^-100 next to any other token is never drawn


def split_prompts(prompt: Any) -> list[Any]:
    """The prompts of a request: one, or a batch."""
    if isinstance(prompt, list) and prompt and not _is_one_mixed(prompt):
        return list(prompt)
    return [prompt]


def _is_one_mixed(items: list[Any]) -> bool:
    """Token ids, or ids and texts mixed: one prompt (a list of texts alone is a batch, as llama-server reads it)."""
    ints = [_is_token(x) for x in items]
    strs = [isinstance(x, str) for x in items]
    return all(a or b for a, b in zip(ints, strs, strict=True)) and any(ints)


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompt_tokens(tokenizer: Tokenizer, prompt: Any, add_special: bool = True) -> list[int]:
    """One prompt's token ids (run in a worker thread: a long text takes a while)."""
    if isinstance(prompt, dict):
        if prompt.get(MULTIMODAL_KEY):
            raise InvalidParameterError("images and audio (multimodal_data) are not supported by this model", "prompt")
        text = prompt.get(PROMPT_STRING_KEY)
        if not isinstance(text, str):
            raise InvalidParameterError(f"a JSON prompt needs a string {PROMPT_STRING_KEY!r}", "prompt")
        return prompt_tokens(tokenizer, text, add_special)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=add_special)
    if isinstance(prompt, list):
        ids: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, str):
                ids += tokenizer.encode(part, add_special_tokens=add_special and i == 0)
            elif _is_token(part):
                ids.append(part)
            else:
                raise InvalidParameterError("a prompt list holds token ids and strings only", "prompt")
        return ids
    raise InvalidParameterError("prompt must be a string, token ids, a list of either, or {'prompt_string': ...}")


def logit_bias(
    tokenizer: Tokenizer, bias: list[list[Any]] | dict[str, Any] | None, ignore_eos: bool = False
) -> dict[int, float] | None:
    """llama.cpp's logit_bias as {token id: bias}; false (a ban) becomes BAN, the strongest bias there is. With
    ignore_eos every end-of-generation token is banned, as llama-server adds them to its logit_bias."""
    out: dict[int, float] = {t: BAN for t in sorted(tokenizer.stop_token_ids)} if ignore_eos else {}
    if bias is None:
        return out or None
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    for pair in pairs:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise InvalidParameterError("logit_bias entries are [token id or text, bias]", "logit_bias")
        key, value = pair
        if value is False:
            value = BAN
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidParameterError(f"logit_bias for {key!r} must be a number or false", "logit_bias")
        for token in _bias_tokens(tokenizer, key):
            out[token] = float(value)
    return out


def _bias_tokens(tokenizer: Tokenizer, key: Any) -> list[int]:
    if _is_token(key):
        return [key]
    if isinstance(key, str) and key.lstrip("-").isdigit():  # a JSON object's keys are strings: {"15043": -100}
        return [int(key)]
    if isinstance(key, str):
        return tokenizer.encode(key, add_special_tokens=False)
    raise InvalidParameterError(f"logit_bias key {key!r} is neither a token id nor a text", "logit_bias")
