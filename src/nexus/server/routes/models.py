"""``GET /v1/models``, ``GET /v1/models/{id}`` (OpenAI list shapes) and ``GET /healthz``."""

from __future__ import annotations

import os
from typing import Any

from aiohttp import web

from ...errors import ServerShuttingDown
from .. import state
from ..key_admission import admit, authenticate
from .common import check_open, json_response


def _model(model_id: str, owner: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": owner}


def _owner(engine: Any, model_id: str) -> str:
    if model_id in engine.aliases:
        return "nexus"
    return model_id.partition("/")[0]


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[state.ENGINE]
    key = authenticate(request)
    await admit(request, key, None)
    data = [_model(m, _owner(engine, m)) for m in engine.models() if key is None or key.allows(m)]
    return json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    engine = request.app[state.ENGINE]
    model_id = request.match_info["model"]
    key = authenticate(request)
    # The key's allow-list first: a model it may not use is 403 whether it exists or not,
    # as on the POST endpoints (a 404 for the others only would list them).
    await admit(request, key, model_id)
    engine.route(model_id)  # raises ModelNotFound
    return json_response(_model(model_id, _owner(engine, model_id)))


async def healthz(request: web.Request) -> web.Response:
    check_open(request)
    runtime = request.app[state.RUNTIME]
    if runtime.draining:  # still serving, but a load balancer is to stop sending here
        raise ServerShuttingDown("The server is shutting down; retry the request.")
    body = {
        "status": "ok",
        "streams": len(request.app[state.HUB].live),
        "clients": len(runtime.active) + len(runtime.sockets),
        "pid": os.getpid(),  # which worker answered, with `nexus serve --workers N`
    }
    return json_response(body)
