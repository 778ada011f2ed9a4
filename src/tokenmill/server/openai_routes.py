"""OpenAI's routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings, registered once in a router
that the app serves both under /v1 and at the root (/chat/completions, /models, /embeddings), as llama.cpp's
server answers both: a client configured with the server's address alone, without /v1, still works. Not
/completions: there llama.cpp's server answers with its own completion API (server/llamacpp.py), and so does
tokenmill's."""

from pathlib import Path

from fastapi import APIRouter, FastAPI, Request

from tokenmill.server import schemas
from tokenmill.server.chat import create_chat_completion
from tokenmill.server.completions import create_completion
from tokenmill.server.embeddings import EmbeddingRequest, create_embeddings
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.schemas import error_responses, streaming_ok
from tokenmill.server.state import ServerState

# the paths served without /v1 too (the API key guards them as it guards /v1/*)
ROOT_PATHS = ("/models", "/chat/completions", "/embeddings")


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    router = APIRouter()  # under /v1 and at the root
    v1_only = APIRouter()
    with_model = error_responses(400, 401, 404, 413, 503)

    def model_card(name: str, request: Request) -> dict:
        model = state.require_model()
        return {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "tokenmill",
            "root": state.shown_path(request),
            "max_model_len": model.max_model_len,
            "aliases": state.model_names,  # llama-server's: every name of the model, and its --tags
            "tags": state.settings.tags,
            "parent": None,
        }

    def adapter_cards(request: Request) -> list[dict]:
        """The LoRA adapters, as vLLM lists them: their own id and root (the adapter's path), the model as parent."""
        base = model_card(state.model_name, request)
        shown = state.shown_path(request) != state.model_path  # a caller without the key sees no directories
        return [
            {
                **base,
                "id": a.name,
                "root": Path(a.path).name if shown else a.path,
                "aliases": [a.name],
                "parent": state.model_name,
            }
            for a in state.require_model().lora_adapters()
        ]

    # every name the model answers to (its id first; the name the server was started with, as vLLM lists the
    # names of --served-model-name)
    @router.get("/models", response_model=schemas.ModelList, responses=error_responses(401, 503))
    async def models(request: Request) -> dict:
        state.require_engine()
        cards = [model_card(name, request) for name in state.model_names]
        return {"object": "list", "data": cards + adapter_cards(request)}

    # the OpenAI client's models.retrieve(id); ids with a slash ("org/name") are one path
    @router.get("/models/{model_id:path}", response_model=schemas.ModelCard, responses=error_responses(401, 404, 503))
    async def model(model_id: str, request: Request) -> dict:
        state.require_engine()
        adapter = next((card for card in adapter_cards(request) if card["id"] == model_id), None)
        if adapter is not None:
            return adapter
        if model_id not in state.model_names:
            raise APIError(
                404,
                f"The model '{model_id}' does not exist (this server serves '{state.model_name}')",
                param="model",
                code="model_not_found",
            )
        return model_card(model_id, request)

    @v1_only.post("/completions", responses={**streaming_ok(schemas.CompletionResponse), **with_model})
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(req, request, state)

    @router.post("/chat/completions", responses={**streaming_ok(schemas.ChatCompletionResponse), **with_model})
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(req, request, state)

    @router.post("/embeddings", response_model=schemas.EmbeddingResponse, responses=with_model)
    async def embeddings(req: EmbeddingRequest, request: Request):
        return await create_embeddings(req, request, state)

    app.include_router(v1_only, prefix="/v1")
    app.include_router(router, prefix="/v1")
    app.include_router(router, include_in_schema=False)  # the same routes at the root, documented once
