"""llama-server's answers to /completion: the final object (content, tokens, stop_type, timings, generation
settings, ...), the partial objects of a stream, and `n_probs`' completion_probabilities, in its field names."""

import math
from dataclasses import dataclass
from typing import Any

from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.llamacpp_prompts import BAN
from tokenmill.server.neutral_request import OutputLength
from tokenmill.tokenizer import Tokenizer


@dataclass(frozen=True)
class CompletionSettings:
    """What a /completion runs with, as its answer's generation_settings shows it."""

    params: SamplingParams  # max_tokens unset: Generation settles it from `output`
    output: OutputLength
    n_predict: int  # what it is settled to, before the prompt is known (-1: up to the context's end)
    stream: bool
    n_probs: int
    seed: int | None  # the request's, else the server's --seed

    def as_json(self) -> dict[str, Any]:
        p = self.params
        return {
            "seed": self.seed,
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "repeat_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "stop": list(p.stop_strings),
            "max_tokens": self.n_predict,
            "n_predict": self.n_predict,
            "ignore_eos": p.ignore_eos,
            "stream": self.stream,
            # a ban (false, ignore_eos's end tokens) as llama-server shows its -inf: null
            "logit_bias": [
                {"bias": None if bias <= BAN else bias, "token": token} for token, bias in (p.logit_bias or {}).items()
            ],
            "n_probs": self.n_probs,
            "post_sampling_probs": p.processed_logprobs,
        }


def stop_type(o: CompletionOutput) -> str:
    """llama.cpp's stop_type: eos (an end token), word (a stop string), limit (n_predict), none (not stopped)."""
    if o.finish_reason == "length":
        return "limit"
    if o.finish_reason == "stop":
        return "word" if isinstance(o.stop_reason, str) else "eos"
    return "none"


def timings(out: RequestOutput) -> dict[str, float | int]:
    """llama-server's timings: the prompt's tokens computed (cache_n: read from the prefix cache) and the time they
    took; the output's tokens and the time after the first one (which comes with the prompt's last step, so the
    rate is over n - 1 decode steps, as llama-server counts it)."""
    o, m = out.outputs[0], out.metrics
    prompt_n = len(out.prompt_token_ids) - out.num_cached_tokens
    predicted_n = len(o.token_ids)
    start = m.first_scheduled_time or m.arrival_time
    first = m.first_token_time or start
    last = m.last_token_time or first
    prompt_ms = max(first - start, 1e-6) * 1e3
    predicted_ms = max(last - first, 1e-6) * 1e3 if predicted_n else 0.0
    steps = max(predicted_n - 1, 0)
    return {
        "cache_n": out.num_cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 / prompt_ms * prompt_n,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": 1e3 / predicted_ms * steps if steps else 0.0,
    }


def probabilities(
    tokenizer: Tokenizer, token_ids: list[int], positions: list[PositionLogprobs], k: int, post_sampling: bool = False
) -> list:
    """completion_probabilities: each generated token with its log-probability and the k most likely tokens';
    `post_sampling` (post_sampling_probs): probabilities ("prob", "top_probs") of the distribution the token was
    drawn from, the tokens it could not draw left out."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        piece = tokenizer.token_bytes(token)
        value = {"prob": math.exp(logprob)} if post_sampling else {"logprob": logprob}
        return {"id": token, "token": piece.decode("utf-8", "ignore"), "bytes": list(piece), **value}

    out = []
    for token, position in zip(token_ids, positions, strict=True):
        ranked = sorted(position.items(), key=lambda item: item[1].rank)
        top = [entry(tid, lp.logprob) for tid, lp in ranked if lp.rank <= k and lp.logprob != -math.inf]
        key = "top_probs" if post_sampling else "top_logprobs"
        out.append({**entry(token, position[token].logprob), key: top})
    return out


def final_json(
    out: RequestOutput,
    content: str,
    tokens: list[int],
    settings: CompletionSettings,
    model: str,
    slot: int,
    prompt_text: str,
) -> dict[str, Any]:
    """The last answer of a prompt (the whole answer unless streamed: then `content` is the last piece)."""
    o = out.outputs[0]
    return {
        "index": 0,
        "content": content,
        "tokens": tokens,
        "id_slot": slot,
        "stop": True,
        "model": model,
        "tokens_predicted": len(o.token_ids),
        "tokens_evaluated": len(out.prompt_token_ids),
        "generation_settings": settings.as_json(),
        "prompt": prompt_text,
        "has_new_line": "\n" in o.text,
        "truncated": False,  # a prompt too long for the context is refused (400), never cut
        "stop_type": stop_type(o),
        "stopping_word": o.stop_reason if isinstance(o.stop_reason, str) else "",
        "tokens_cached": len(out.prompt_token_ids) + max(len(o.token_ids) - 1, 0),
        "timings": timings(out),
    }


def partial_json(out: RequestOutput, content: str, tokens: list[int], slot: int) -> dict[str, Any]:
    """One piece of a streamed answer."""
    return {
        "index": 0,
        "content": content,
        "tokens": tokens,
        "stop": False,
        "id_slot": slot,
        "tokens_predicted": len(out.outputs[0].token_ids),
        "tokens_evaluated": len(out.prompt_token_ids),
    }


def only_fields(body: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """response_fields: the named fields only, keyed by their path ("generation_settings/n_predict")."""
    picked: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            picked[path] = value
    return picked
