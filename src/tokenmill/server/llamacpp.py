"""llama.cpp's own API (what llama-server's web UI and many tools speak): POST /completion and /completions,
/apply-template, GET and POST /props, GET /slots and POST /slots/{id}?action=erase|save|restore (save and restore:
llamacpp_slot_files.py), and /tokenize's `content` shape (llama_tokenize, used by app.py's /tokenize). /health,
/metrics (its llamacpp:* names: metrics.py), /infill (infill.py) and /detokenize's `content` are answered where
the other APIs' are."""

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from tokenmill import __version__
from tokenmill.server.chat import render_chat
from tokenmill.server.errors import APIError
from tokenmill.server.llamacpp_completion import completion_settings, create_llama_completion
from tokenmill.server.llamacpp_prompts import prompt_tokens
from tokenmill.server.llamacpp_protocol import (
    ApplyTemplateRequest,
    LlamaCompletionRequest,
    PropsUpdate,
    SlotFileRequest,
)
from tokenmill.server.llamacpp_slot_files import restore_slot, save_slot, slot_file
from tokenmill.server.llamacpp_slots import SlotTable
from tokenmill.server.schemas import ANY_LIST, ANY_OBJECT_OR_LIST, answers, error_responses
from tokenmill.server.served_model import ServedModel
from tokenmill.server.state import ServerState
from tokenmill.server.stream_or_collect import SHUTDOWN_ERROR

NOT_SUPPORTED = 501  # llama-server's status for an endpoint this server was started without


class LlamaServer:
    """What llama.cpp's API keeps beside the engine: its slots (made once the model is loaded, one per sequence
    the engine batches) and the defaults POST /props set."""

    def __init__(self, state: ServerState):
        self.state = state
        self._slots: SlotTable | None = None
        self.defaults: dict[str, Any] = {}  # POST /props' sampling defaults, over the model's

    def slots(self) -> SlotTable:
        model = self.state.require_model()
        if self._slots is None:
            self._slots = SlotTable(model.config.max_num_seqs, model.max_model_len)
        return self._slots


def add_llamacpp_routes(app: FastAPI, state: ServerState) -> None:
    llama = LlamaServer(state)
    app.state.llamacpp = llama
    errors = error_responses(400, 401, 404, 413, 503)

    async def completion(req: LlamaCompletionRequest, request: Request):
        req = req.model_copy(update={k: v for k, v in llama.defaults.items() if k not in req.model_fields_set})
        return await create_llama_completion(req, request, state, llama.slots(), request.url.path)

    for path in ("/completion", "/completions"):
        app.post(
            path,
            responses={
                **answers(
                    "llama.cpp's completion (a list for a batch of prompts)", "text/event-stream", ANY_OBJECT_OR_LIST
                ),
                **errors,
            },
        )(completion)

    @app.post("/apply-template", responses={**answers("the prompt the chat template makes"), **errors})
    async def apply_template(req: ApplyTemplateRequest) -> dict:
        model = state.require_model()
        messages = [m.model_dump(exclude_unset=True) for m in req.messages]
        functions = [t["function"] for t in req.tools or [] if isinstance(t.get("function"), dict)]
        prompt = await asyncio.to_thread(
            render_chat, model, messages, functions, req.add_generation_prompt, req.chat_template_kwargs
        )
        return {"prompt": prompt}

    @app.get("/props", responses={**answers("the server's properties, as llama-server's"), **errors})
    async def props(request: Request) -> dict:
        return _props(state, llama, request)

    @app.post("/props", responses={**answers("the new defaults taken"), **errors})
    async def set_props(update: PropsUpdate) -> dict:
        """Change /completion's defaults (default_generation_settings.params: temperature, top_k, top_p, min_p,
        repeat_penalty, presence_penalty, frequency_penalty, seed, n_predict); checked as a request's are."""
        values = update.params()
        model = state.require_model()
        completion_settings(LlamaCompletionRequest(**{**llama.defaults, **values}), state, model)  # 400 if bad
        llama.defaults |= values
        return {"success": True}

    @app.get(
        "/slots",
        responses={**answers("each slot, as llama-server's", schema=ANY_LIST), **error_responses(401, 501, 503)},
    )
    async def slots(fail_on_no_slot: str | None = None) -> list[dict[str, Any]]:
        if not state.settings.slots_endpoint:
            raise APIError(
                NOT_SUPPORTED, "this server does not list its slots: start it with --slots", "not_supported_error"
            )
        table = llama.slots()
        if fail_on_no_slot and all(s.is_processing for s in table.slots):
            raise APIError(503, "no slot available", "unavailable_error")
        return [s.as_json() for s in table.slots]

    @app.post("/slots/{id_slot}", responses={**answers("the action's result"), **error_responses(400, 401, 501, 503)})
    async def slot_action(id_slot: str, action: str = "", body: SlotFileRequest | None = None) -> dict:
        """erase: the slot forgets its tokens, and the prefix cache their blocks; save and restore (with
        --slot-save-path): its tokens and their K/V to a file and back (llamacpp_slot_files.py). Each waits for
        the slot's task to end, as llama-server defers it."""
        if not id_slot.isdigit():
            raise APIError(400, "Invalid slot ID", param="id_slot")
        table = llama.slots()
        table.check_id(int(id_slot))
        if action not in ("erase", "save", "restore"):
            raise APIError(400, "Invalid action: erase, save or restore", param="action")
        file = None if action == "erase" else slot_file(state, body.filename if body is not None else None)
        async with table.hold(int(id_slot)) as slot:
            if file is not None:
                act = save_slot if action == "save" else restore_slot
                return await act(state, slot, *file)
            erased, slot.tokens = slot.tokens, []
            await state.require_engine().forget_prefix(erased)
            return {"id_slot": slot.id, "n_erased": len(erased)}


def llama_tokenize(model: ServedModel, content: Any, add_special: bool, with_pieces: bool) -> dict:
    """llama-server's /tokenize answer: {"tokens": ids}, or with_pieces [{"id", "piece"}] (a piece that is no
    whole UTF-8 text is its list of bytes). Runs in a worker thread."""
    tokenizer = model.tokenizer
    ids = prompt_tokens(tokenizer, content, add_special)
    bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)  # ids come mixed into content too
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of vocabulary (ids 0..{tokenizer.vocab_size - 1})", param="content")
    if not with_pieces:
        return {"tokens": ids}
    pieces = []
    for token in ids:
        piece = tokenizer.token_bytes(token)
        try:
            text: str | list[int] = piece.decode("utf-8")
        except UnicodeDecodeError:
            text = list(piece)
        pieces.append({"id": token, "piece": text})
    return {"tokens": pieces}


def _props(state: ServerState, llama: LlamaServer, request: Request) -> dict:
    if state.shutting_down:
        raise SHUTDOWN_ERROR
    model = state.require_model()
    settings = completion_settings(LlamaCompletionRequest(**llama.defaults), state, model)
    tokenizer = model.tokenizer
    return {
        "default_generation_settings": {"params": settings.as_json(), "n_ctx": model.max_model_len},
        "total_slots": model.config.max_num_seqs,
        "model_alias": state.model_name,
        "model_path": state.shown_path(request),
        "modalities": {"vision": False, "audio": False, "video": False},
        "endpoint_slots": state.settings.slots_endpoint,
        "endpoint_props": True,
        "endpoint_metrics": state.settings.metrics,
        "ui": state.settings.explorer,
        "chat_template": model.own_chat_template or "",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "build_info": f"tokenmill {__version__}",
        "is_sleeping": False,
    }
