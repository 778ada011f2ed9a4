"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, bodies {lora_name,
lora_path}, only with --allow-runtime-lora-updating (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING; else 403). Success is
vLLM's plain-text line; a bad path or adapter is a 400, a name already loaded a 400, an
unknown one on unload a 404, each in OpenAI's error shape. A loaded adapter is a model to every OpenAI and Ollama
generation API (`model: NAME`) and is listed by /v1/models with its base model as `parent`."""

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from tokenmill.engine.lora_registry import LoRANotFoundError
from tokenmill.loader.lora_file import LoRAError
from tokenmill.server.errors import APIError, disabled
from tokenmill.server.schemas import error_responses
from tokenmill.server.state import ServerState


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's load_inplace and others: accepted, not used
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, ignored: the name decides


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    # the success line is text, the errors OpenAI's JSON (a plain-text response class would document both as text)
    text = {"text/plain": {"schema": {"type": "string"}}}
    answers = {200: {"content": text, "description": "vLLM's success line"}, **error_responses(400, 401, 403, 404, 503)}

    def check_allowed() -> None:
        if not state.settings.allow_runtime_lora_updating:
            raise disabled("--allow-runtime-lora-updating")

    @app.post("/v1/load_lora_adapter", response_class=Response, responses=answers)
    async def load_lora_adapter(req: LoadLoRARequest) -> Response:
        check_allowed()
        engine = state.require_engine()
        if not req.lora_name or not req.lora_path:
            raise APIError(400, "both lora_name and lora_path must be given", param="lora_name")
        if req.lora_name in state.model_names:
            raise APIError(400, f"{req.lora_name!r} is the served model's name", param="lora_name")
        try:
            await engine.load_lora(req.lora_name, req.lora_path)
        except LoRAError as exc:  # its message names the file; the caller sent that path
            raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=Response, responses=answers)
    async def unload_lora_adapter(req: UnloadLoRARequest) -> Response:
        check_allowed()
        engine = state.require_engine()
        try:
            await engine.unload_lora(req.lora_name)
        except LoRANotFoundError as exc:
            raise APIError(404, str(exc), param="lora_name", code="lora_not_found") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
