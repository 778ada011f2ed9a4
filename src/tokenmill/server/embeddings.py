"""POST /v1/embeddings (OpenAI's, also what llama.cpp's and vLLM's servers answer): one vector per input, its final
hidden states pooled by the engine (tokenmill.PoolingParams), as float lists or base64 of little-endian float32."""

import base64
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.server.completions import split_prompts
from tokenmill.server.generation import Generation
from tokenmill.server.neutral_request import NeutralRequest
from tokenmill.server.prompt_shapes import prompt_problem
from tokenmill.server.protocol import MAX_EMBEDDING_INPUTS, APIRequest
from tokenmill.server.request_ids import call_id, echo
from tokenmill.server.state import ServerState
from tokenmill.server.stream_or_collect import SHUTDOWN_ERROR


class EmbeddingRequest(APIRequest):
    refuses_unknown_fields = True

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None  # the first this many values (then normalized)
    user: str | None = None
    pooling: Literal["mean", "last"] = "mean"  # vLLM's and llama.cpp's servers take the model's: tokenmill's choice
    normalize: bool = True
    # vLLM's: each input cut to this many tokens (-1: as many as the context allows), its end cut ("right", the
    # default for embeddings) or its start ("left")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] = "right"

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        problem = prompt_problem(value, MAX_EMBEDDING_INPUTS, "input")
        if problem is not None:
            raise PydanticCustomError("input_shape", problem)
        return value


async def create_embeddings(req: EmbeddingRequest, http_request: Request, state: ServerState):
    client_id, request_id = call_id(http_request, "embd")
    state.check_model(req.model)
    state.require_engine()
    params = PoolingParams(req.pooling, req.normalize, req.dimensions, req.truncate_prompt_tokens, req.truncation_side)
    generation = Generation(state, split_prompts(req.input), NeutralRequest(params), request_id, "/v1/embeddings")
    await generation.start(http_request)
    finals = await generation.collect(http_request)  # a client that leaves: ClientDisconnected, answered 499
    tokens = sum(len(f.prompt_token_ids) for f in finals)
    body = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(f, req.encoding_format)}
            for i, f in enumerate(finals)
        ],
        "model": state.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return JSONResponse(body, headers=echo(client_id))


def _encoded(final: RequestOutput, encoding_format: str) -> list[float] | str:
    vector = final.embedding
    if vector is None:  # aborted: the server is stopping
        raise SHUTDOWN_ERROR
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
