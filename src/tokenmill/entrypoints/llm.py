"""The offline API: `LLM(...).generate(prompts, sampling_params)`, everything run through the batching engine."""

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.beam_search import BeamSearch, BeamSearchOutput
from tokenmill.engine.llm_engine import LLMEngine, PromptInput
from tokenmill.entrypoints.model_names import find_model
from tokenmill.errors import InvalidParameterError
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import BeamSearchParams, SamplingParams
from tokenmill.tokenizer import Tokenizer

Conversation = list[dict[str, Any]]


class LLM:
    """An engine on one model. `model=None` is the bundled SmolLM2-135M-Instruct; "ORG/NAME" (with `revision`) or
    "ORG/NAME-GGUF:QUANT" (or `hf_file`) a Hugging Face Hub model, downloaded into the Hub's cache first.

    dtype: compute dtype ("float32", "bfloat16", "float16"). quantization: None dequantizes the GGUF weights.
    options: engine options (block_size, num_kv_blocks, kv_cache_memory, enable_prefix_caching, max_num_seqs,
    max_num_batched_tokens, max_model_len, device, seed, tensor_parallel_size, collective_timeout_s,
    generation_config). Without sampling params, `generate` and `chat` use `get_default_sampling_params()`: the
    model's recommended settings where it has them (generation_config="tokenmill": SamplingParams' defaults).
    With tensor_parallel_size N > 1 this process is rank 0 and starts N-1 worker processes (or meets the ranks
    torchrun started); `close()` stops them (they also stop when this process exits).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "float32",
        quantization: str | None = None,
        revision: str | None = None,
        hf_file: str | None = None,
        **options,
    ):
        local = find_model(None if model is None else str(model), revision, hf_file)  # a Hub model: downloaded
        self.engine = LLMEngine(local, dtype, quantization, EngineConfig.from_options(options))

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel model; later calls to generate raise EngineClosedError."""
        self.engine.close()

    def load_lora(self, name: str, path: str) -> None:
        """Serve a LoRA adapter (a PEFT directory or a GGUF LoRA file) as `name`: requests whose
        SamplingParams.lora_name is `name` generate with it (as `lora_modules={name: path}` at construction)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """The model's recommended sampling settings (its generation config; see `generation_config`) with
        `overrides` on top: what `generate` and `chat` use when given no sampling params."""
        return SamplingParams(**{**self.engine.generation_defaults.values, **overrides})

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or {"prompt_token_ids": [...]}); outputs in prompt order."""
        prompt_list = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidParameterError(
                    f"{len(params_list)} sampling params for {len(prompt_list)} prompts", "sampling_params"
                )
        return self._run(prompt_list, params_list, use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py): for each prompt (a string, {"prompt": text} or
        {"prompt_token_ids": [...]}) its best `params.beam_width` beams, best first; a beam's `tokens` and `text`
        include the prompt's, as vLLM's. Each round, every live beam of every prompt asks the engine for one token
        (one request each, run together), so a round costs about a decode step of beam_width x prompts sequences
        plus their last partial blocks, which the prefix cache cannot hold."""
        engine = self.engine
        texts = [_text_prompt(p) for p in _prompt_list(prompts)]
        tokenized = [engine.tokenize_prompt(p) for p in texts]
        search = BeamSearch(tokenized, params, engine.tokenizer, engine.max_model_len)
        engine.check_params(search.round_params)
        bar = tqdm(total=search.max_rounds, desc="Beam search", unit="round", disable=not use_tqdm, dynamic_ncols=True)
        with bar:

            def run_round(beams: list[list[int]], one_token: SamplingParams) -> list[RequestOutput]:
                bar.update(1)
                return self._run([{"prompt_token_ids": b} for b in beams], [one_token] * len(beams), False)

            search.run(run_round)
        return search.outputs()

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[list[float]]:
        """One vector per prompt (its final hidden states pooled: PoolingParams, by default their mean,
        normalized), batched with whatever else runs; in prompt order."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = pooling_params or PoolingParams()
        outputs = self._run(prompt_list, [params] * len(prompt_list), use_tqdm)
        return [o.embedding for o in outputs]  # type: ignore[misc]

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Render the chat template over one conversation (or a list of them) and generate the replies;
        `continue_final_message` (with add_generation_prompt=False): the model goes on with the final message."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptInput] = []
        for c in conversations:
            ids = self.engine.encode_chat(c, add_generation_prompt, continue_final_message=continue_final_message)  # type: ignore[arg-type]
            prompts.append({"prompt_token_ids": ids, "prompt": None})
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate_stream(
        self, prompt: PromptInput, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (deltas in `delta_text`)."""
        engine = self.engine
        request_id = engine.add_request(None, prompt, sampling_params or self.get_default_sampling_params())
        done = False
        try:
            while not done:
                for out in engine.step():
                    if out.request_id == request_id:
                        done = out.finished
                        yield out
                if not done and request_id not in engine.requests:
                    raise RuntimeError("the engine dropped the request")
        finally:
            if not done:
                engine.abort(request_id)

    def _run(
        self, prompts: list[PromptInput], params: Sequence[SamplingParams | PoolingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        group = f"generate-{engine.new_request_id()}"  # one call: its prompts take their turns together
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(engine.add_request(None, prompt, p, group=group))
        except Exception:
            for request_id in ids:  # a bad prompt rejects the whole call; nothing is left half-run
                engine.abort(request_id)
            raise
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start = time.monotonic()
        output_tokens = 0
        try:
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.request_id in wanted:
                        output_tokens += sum(len(o.delta_token_ids) for o in out.outputs)
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
                if use_tqdm:
                    elapsed = max(time.monotonic() - start, 1e-9)
                    bar.set_postfix_str(f"{output_tokens / elapsed:.1f} out tok/s", refresh=False)
                if not engine.has_unfinished_requests() and len(finished) < len(ids):
                    raise RuntimeError("the engine stopped with requests unfinished")
        except BaseException:
            for request_id in wanted - set(finished):
                engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, Iterable):
        return list(prompts)
    raise InvalidParameterError(
        "prompts must be a string, a {'prompt_token_ids': [...]} dict, or a list of them; "
        f"got {type(prompts).__name__}",
        "prompts",
    )


def _text_prompt(prompt: PromptInput) -> PromptInput:
    """vLLM's TextPrompt, {"prompt": text}, as its text."""
    return prompt["prompt"] if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
