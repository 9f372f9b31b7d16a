"""docs/configuration.md documents every key the loader knows, no key it does not, and each
documented default is the loader's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from nexus import config as c

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

TABLES: dict[str, tuple[type[BaseModel], ...]] = {
    "[server]": (c.ServerConfig,),
    "[limits]": (c.LimitsConfig,),
    "[auth]": (c.AuthConfig,),
    "[[auth.keys]]": (c.AuthKeyConfig,),
    "[cors]": (c.CorsConfig,),
    "[logging]": (c.LoggingConfig,),
    "[metrics]": (c.MetricsConfig,),
    "[telemetry]": (c.TelemetryConfig,),
    "[realtime]": (c.RealtimeConfig,),
    "[streams]": (c.StreamsConfig,),
    "[cache]": (c.CacheConfig,),
    "[store]": (c.MemoryStoreConfig, c.RedisStoreConfig),
    "[providers.<name>]": (
        c.MockProviderConfig,
        c.OpenAIProviderConfig,
        c.AnthropicProviderConfig,
    ),
    '[models."<name>"]': (c.ModelAliasConfig,),
    "[[plugins]]": (c.PluginConfig,),
    "[encoders]": (),
}


def sections() -> dict[str, list[list[str]]]:
    """Each ``## `[table]` `` section's table rows, as lists of cells."""
    out: dict[str, list[list[str]]] = {}
    rows: list[list[str]] | None = None
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^#{2,3} `(.+)`$", line)
        if heading:
            rows = out.setdefault(heading.group(1), [])
        elif line.startswith("## "):
            rows = None
        elif rows is not None and line.startswith("| `"):
            rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return out


def test_every_table_has_a_section() -> None:
    assert set(sections()) == set(TABLES)
    roots = {table.strip("[]").split(".")[0] for table in TABLES}
    assert roots == set(c.Config.model_fields)


@pytest.mark.parametrize("table", list(TABLES))
def test_the_keys_are_the_loaders(table: str) -> None:
    documented = {row[0].strip("`") for row in sections()[table]}
    known = {name for model in TABLES[table] for name in model.model_fields}
    assert documented == known, f"{table}: missing {known - documented}, extra {documented - known}"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


@pytest.mark.parametrize("table", [t for t, models in TABLES.items() if len(models) == 1])
def test_the_defaults_are_the_loaders(table: str) -> None:
    (model,) = TABLES[table]
    for row in sections()[table]:
        field = model.model_fields[row[0].strip("`")]
        shown = re.match(r"^`([^`]+)`", row[1])
        if shown is None or field.is_required():
            continue  # "(required)", "unset", "the input price": prose, not a value
        default = field.get_default(call_default_factory=True)
        assert shown.group(1) in (_toml(default), str(default)), f"{table} {row[0]}"
