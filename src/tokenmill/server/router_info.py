"""What a router in front of several `tokenmill serve` replicas reads (the SGLang model gateway, `sglang-router
launch --worker-urls ...`): /server_info and /model_info when it registers a replica (the served model's name,
its limits), and /get_load (how busy the replica is). The older /get_* names are answered too."""

from fastapi import FastAPI, Request

from tokenmill import __version__
from tokenmill.server.schemas import ANY_OBJECT, answers, error_responses
from tokenmill.server.state import ServerState


def add_router_routes(app: FastAPI, state: ServerState) -> None:
    def server_info(request: Request) -> dict:
        model = state.require_model()
        config = model.config
        return {
            "model_path": state.shown_path(request),
            "served_model_name": state.model_name,
            "version": f"tokenmill {__version__}",
            "tp_size": config.tensor_parallel_size,
            "dp_size": 1,
            "max_running_requests": config.max_num_seqs,
            "max_prefill_tokens": config.max_num_batched_tokens,
            "max_total_tokens": model.kv_blocks_total * config.block_size,  # the KV cache's room, in tokens
            "max_model_len": model.max_model_len,
        }

    def model_info(request: Request) -> dict:
        facts = state.require_model().facts
        return {
            "model_path": state.shown_path(request),
            "tokenizer_path": state.shown_path(request),
            "is_generation": True,
            "model_type": facts.architecture,
            "architectures": [facts.architecture],
        }

    def load() -> list[dict]:
        """One entry per data-parallel rank (one here), as SGLang's workers answer it."""
        async_engine = state.require_engine()
        stats = async_engine.stats()
        in_use = stats["kv_blocks_in_use"] * stats["block_size"]
        running, waiting = stats["num_running"], stats["num_waiting"]
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": in_use}]

    errors = error_responses(401, 503)
    app.get("/server_info", responses={**answers("the server, as SGLang's workers describe theirs"), **errors})(
        server_info
    )
    app.get("/model_info", responses={**answers("the model, as SGLang's workers describe theirs"), **errors})(
        model_info
    )
    per_rank = {"content": {"application/json": {"schema": {"type": "array", "items": ANY_OBJECT}}}}
    app.get("/get_load", responses={200: {**per_rank, "description": "load per data-parallel rank"}, **errors})(load)
    app.get("/get_server_info", include_in_schema=False)(server_info)
    app.get("/get_model_info", include_in_schema=False)(model_info)
