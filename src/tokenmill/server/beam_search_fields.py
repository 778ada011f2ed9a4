"""vLLM's `use_beam_search` on OpenAI's completions and chat: a request's fields as BeamSearchParams (`n` is the beam
width; `length_penalty`, `ignore_eos`, `include_stop_str_in_output`, `skip_special_tokens`, `max_tokens`,
`temperature` as vLLM's `to_beam_search_params` reads them), and a 400 naming each field that asks for what a beam
search does not do. vLLM ignores those (its beams never sample, stop at a string or follow a constraint); here
nothing is ignored. Streamed completions are refused and a streamed chat sends its whole answer at the end, as
vLLM's servers do.
"""

from typing import Any

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import MAX_BEAM_WIDTH, BeamSearchParams
from tokenmill.server.protocol import CompletionRequest, SamplingFields

# fields a beam search does not follow, with the values that ask for nothing (any other value is refused)
NOT_FOR_BEAMS: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,),
    "top_k": (0, -1),
    "min_p": (0.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "logit_bias": ({},),
    "stop": ([],),
    "stop_token_ids": ([],),
    "min_tokens": (0,),
    "vllm_xargs": ({},),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "grammar": (),
    "json_schema": (),
    "thinking_token_budget": (-1,),
    # vLLM's request extensions that act on the sampled tokens or the prompt's (a beam ranks its own candidates)
    "allowed_token_ids": (),
    "logprob_token_ids": (),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,),
}


def beam_search_params(req: SamplingFields, defaults: dict[str, Any] | None = None) -> BeamSearchParams:
    """The request's beam search (it has use_beam_search: true); raises InvalidParameterError (a 400 naming the
    field) for a field the search would not follow. `defaults`: the model's sampling defaults (its temperature,
    when the request names none, as vLLM's). max_tokens is left unset, as sampling_params leaves it."""
    for name, neutral in NOT_FOR_BEAMS.items():
        value = getattr(req, name, None)
        if value is not None and value not in neutral:
            raise InvalidParameterError(f"{name} is not supported with use_beam_search", name)
    if req.response_format is not None and req.response_format.type != "text":
        raise InvalidParameterError("response_format is not supported with use_beam_search", "response_format")
    tool_choice = getattr(req, "tool_choice", None)
    if tool_choice is not None and tool_choice not in ("none", "auto"):  # a required call is a constraint
        raise InvalidParameterError(
            "tool_choice 'required' or a named function is not supported with use_beam_search", "tool_choice"
        )
    if isinstance(req, CompletionRequest):
        if req.stream:
            raise InvalidParameterError("streaming is not supported with use_beam_search (as vLLM's)", "stream")
        if req.echo and req.logprobs is not None:  # vLLM's reason: no prompt log-probabilities
            raise InvalidParameterError("echo with logprobs is not supported with use_beam_search", "echo")
    if req.n > MAX_BEAM_WIDTH:
        raise InvalidParameterError(
            f"n is the beam width with use_beam_search: at most {MAX_BEAM_WIDTH} (each beam ranks 2 * n tokens "
            f"a round, at most 20 log-probabilities), got {req.n}",
            "n",
        )
    temperature = req.temperature if req.temperature is not None else (defaults or {}).get("temperature", 1.0)
    return BeamSearchParams(
        beam_width=req.n,
        max_tokens=None,
        ignore_eos=req.ignore_eos,
        temperature=temperature,
        length_penalty=req.length_penalty,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=req.sampled_logprobs(),
    )
