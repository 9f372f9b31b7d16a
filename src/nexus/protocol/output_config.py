"""Anthropic's ``output_config`` and OpenAI's ``reasoning_effort`` for either kind of
provider. Sans-I/O.

A request carries either API's field for the same asks: an effort level (Anthropic's
``output_config.effort``, OpenAI's ``reasoning_effort``, which ``/v1/responses``'
``reasoning.effort`` becomes) and structured outputs (``output_config.format``, which
``/v1/messages`` keeps, beside OpenAI's ``response_format``). Each target gets them in its
own API's terms: an Anthropic effort level through :data:`EFFORT_LEVELS` (OpenAI's stays
off Anthropic targets: :func:`anthropic_config`);
Anthropic's format as a ``json_schema`` response format, strict where OpenAI's strict mode
can hold the answer to the schema (:mod:`.strict_schema`). What has no counterpart on a
target is refused there, naming the field and its value (:class:`InvalidRequest`: the
target is skipped, and with none left the request is a 400), and so is a request that asks
for one thing twice, differently: sent without it, the answer would be to another question
than the one asked.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest
from ..request import ChatRequest
from .strict_schema import strict_form

__all__ = ["EFFORT_LEVELS", "FORMAT_NAME", "anthropic_config", "openai_fields", "sent_config"]

EFFORT_LEVELS: dict[str, str] = {
    # OpenAI's reasoning_effort: Anthropic's output_config.effort (the SDKs' literals)
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}
"""Every Anthropic level has an OpenAI one, the same word; OpenAI's ``none`` and
``minimal`` lie below Anthropic's lowest."""
_OPENAI_LEVELS = {anthropic: openai for openai, anthropic in EFFORT_LEVELS.items()}
_LEVELS = "'low', 'medium', 'high', 'xhigh' or 'max'"

FORMAT_NAME = "output"
"""The ``json_schema`` response format's name for Anthropic's format, which has none."""

_CHAT = "Chat Completions"


def sent_config(request: ChatRequest) -> dict[str, Any]:
    """The ``output_config`` the request carries ({} for none). Raises
    :class:`InvalidRequest` for one that is not an object, a format beside a
    ``response_format`` that asks for one, and an effort other than ``reasoning_effort``'s."""
    extra = request.model_extra or {}
    config = extra.get("output_config")
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
    effort, reasoning = config.get("effort"), extra.get("reasoning_effort")
    if effort is not None and reasoning is not None and _level(reasoning) != effort:
        raise InvalidRequest(
            f"output_config.effort: {_shown(effort)}, beside reasoning_effort "
            f"{_shown(reasoning)}, another level; send one of them",
            param="output_config.effort",
        )
    return config


def anthropic_config(request: ChatRequest) -> dict[str, Any]:
    """The ``output_config`` an Anthropic upstream gets (before a ``response_format``'s
    schema joins it): the request's as sent (the upstream judges its own field). Raises
    :class:`InvalidRequest` as :func:`sent_config` does.

    A chat client's ``reasoning_effort`` does not become its ``effort``: not every Claude
    model takes one (those that do not answer 400), so a request that an alias falls back
    with from an OpenAI model to a Claude one would fail where it is served today. It is
    dropped there, as the sampling fields are; a client asks an Anthropic target for a
    level with ``output_config.effort``."""
    return dict(sent_config(request))


def openai_fields(request: ChatRequest, model: str = "") -> dict[str, Any]:
    """The Chat Completions fields for the request's ``output_config``: ``effort`` as
    ``reasoning_effort``, ``format`` as a ``json_schema`` ``response_format`` for the
    upstream ``model`` (see the module's docstring). Raises :class:`InvalidRequest`
    naming the first part of it with no counterpart there."""
    out: dict[str, Any] = {}
    for key, value in sent_config(request).items():
        if value is None:
            continue
        if key == "effort":
            level = _OPENAI_LEVELS.get(value) if type(value) is str else None
            if level is None:
                raise _no_counterpart("output_config.effort", value, _CHAT)
            out["reasoning_effort"] = level
        elif key == "format":
            out["response_format"] = _response_format(value, model)
        else:
            raise InvalidRequest(
                f"output_config.{key}: a setting which this model's provider ({_CHAT}) "
                "cannot honour; send it to a model of an Anthropic provider",
                param=f"output_config.{key}",
            )
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


def _level(reasoning: Any) -> str | None:
    """The Anthropic level of a ``reasoning_effort`` (None: it has none)."""
    return EFFORT_LEVELS.get(reasoning) if type(reasoning) is str else None


def _shown(value: Any) -> str:
    """A client's value as an error quotes it: its ``repr``, cut (it may be any size)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _no_counterpart(param: str, value: Any, api: str) -> InvalidRequest:
    return InvalidRequest(
        f"{param}: {_shown(value)}, an effort level which this model's provider ({api}) cannot "
        f"honour; send {_LEVELS}",
        param=param,
    )
