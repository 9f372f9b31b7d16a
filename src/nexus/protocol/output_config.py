"""Anthropic's ``output_config`` for either kind of provider. Sans-I/O.

``/v1/messages`` keeps its structured outputs (``output_config.format``), and a chat client
may send Anthropic's field too. An Anthropic target gets it as sent; an OpenAI one its
format as a ``json_schema`` response format, strict where OpenAI's strict mode can hold the
answer to the schema as Anthropic does (:mod:`.strict_schema`). Any other part of it is
refused there, naming it (:class:`InvalidRequest`: the target is skipped, and with none
left the request is a 400): sent without it, the answer would be to another question.

That includes ``effort``. Effort levels stay with their own kind of provider, either way:
not every model of the other kind takes one (a non-reasoning OpenAI model, an older Claude
model, answer 400), and an upstream's 400 ends a request, where a refusal here lets an
alias fall back to a target that can. So an OpenAI target refuses ``output_config.effort``,
and an Anthropic one drops ``reasoning_effort``, as it drops the sampling fields.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest
from ..request import ChatRequest
from .strict_schema import strict_form

__all__ = ["FORMAT_NAME", "anthropic_config", "openai_fields", "sent_config"]

FORMAT_NAME = "output"
"""The ``json_schema`` response format's name for Anthropic's format, which has none."""

_CHAT = "Chat Completions"


def sent_config(request: ChatRequest) -> dict[str, Any]:
    """The ``output_config`` the request carries ({} for none). Raises
    :class:`InvalidRequest` for one that is not an object, and a format beside a
    ``response_format`` that asks for one."""
    config = (request.model_extra or {}).get("output_config")
    if config is None:
        return {}
    if type(config) is not dict:
        raise InvalidRequest("output_config: must be an object", param="output_config")
    fmt = request.response_format
    if config.get("format") is not None and fmt is not None and fmt.type != "text":
        raise InvalidRequest(
            "output_config.format: a format beside response_format's; send one of them",
            param="output_config.format",
        )
    return config


def anthropic_config(request: ChatRequest) -> dict[str, Any]:
    """The ``output_config`` an Anthropic upstream gets (before a ``response_format``'s
    schema joins it): the request's as sent (the upstream judges its own field). Raises
    :class:`InvalidRequest` as :func:`sent_config` does."""
    return dict(sent_config(request))


def openai_fields(request: ChatRequest, model: str = "") -> dict[str, Any]:
    """The Chat Completions fields for the request's ``output_config``: its ``format`` as a
    ``json_schema`` ``response_format`` for the upstream ``model``. Raises
    :class:`InvalidRequest` naming any other part of it, ``effort`` included (see the
    module's docstring)."""
    out: dict[str, Any] = {}
    for key, value in sent_config(request).items():
        if value is None:
            continue
        if key != "format":
            raise InvalidRequest(
                f"output_config.{key}: a setting which this model's provider ({_CHAT}) "
                "cannot honour; send it to a model of an Anthropic provider",
                param=f"output_config.{key}",
            )
        out["response_format"] = _response_format(value, model)
    return out


def _response_format(fmt: Any, model: str) -> dict[str, Any]:
    """Anthropic's ``{"type": "json_schema", "schema": ...}`` as a response format:
    ``strict`` with the schema's :func:`~.strict_schema.strict_form` when it has one, else
    the schema as sent, without ``strict``. A fine-tuned OpenAI model (``ft:...``) takes
    no constraint keywords under strict."""
    schema = fmt.get("schema") if type(fmt) is dict else None
    if type(fmt) is not dict or fmt.get("type") != "json_schema" or type(schema) is not dict:
        raise InvalidRequest(
            f"output_config.format: a format which this model's provider ({_CHAT}) cannot "
            'honour; send {"type": "json_schema", "schema": {...}}',
            param="output_config.format",
        )
    strict = strict_form(schema, constraints=not model.startswith("ft:"))
    json_schema: dict[str, Any] = {"name": FORMAT_NAME, "schema": schema}
    if strict is not None:
        json_schema = {"name": FORMAT_NAME, "schema": strict, "strict": True}
    return {"type": "json_schema", "json_schema": json_schema}
