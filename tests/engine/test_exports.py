"""The public surface and the direction of imports (STYLE.md: the shape of the house)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import nexus

SRC = Path(nexus.__file__).parent

PUBLIC = {
    "Audio", "Channel", "ChatRequest", "Citation", "CompletedToolCall", "Completion", "Config",
    "ConfigError", "Delta", "Done", "Encoder", "EncoderRegistry", "EndOfStream", "Engine",
    "Error", "GatewayError", "Heartbeat", "Image", "InvalidRequest", "MockProvider",
    "ModelNotFound", "NexusError", "Provider", "Reasoning", "ReasoningBlock", "RegistryFrozen",
    "Stream",
    "StreamError", "StreamEvent", "StreamMeta", "ToolCall", "UpstreamError", "UpstreamTimeout",
    "Usage", "accumulate", "create_app", "load_config", "register",
    "CallContext", "Hooks", "Middleware", "StreamRejected", "map_stream",
    "Next", "Price", "PriceTable", "Spend",
    "AnthropicProvider", "AnthropicProviderConfig", "OpenAIProvider", "OpenAIProviderConfig",
}  # fmt: skip


def test_all_is_the_documented_surface() -> None:
    assert set(nexus.__all__) == PUBLIC
    for name in nexus.__all__:
        assert getattr(nexus, name) is not None


def _modules() -> list[str]:
    names = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def _imported_after(module: str) -> set[str]:
    code = (
        "import sys; before = set(sys.modules); import importlib; "
        f"importlib.import_module({module!r}); "
        "print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return set(out.split())


@pytest.mark.parametrize(
    "module", [m for m in _modules() if ".server" not in m and m != "nexus.cli"]
)
def test_nothing_below_server_loads_aiohttp_web(module: str) -> None:
    loaded = _imported_after(module)
    assert "aiohttp.web" not in loaded
    assert "nexus.server" not in loaded


def _imports(path: Path) -> set[str]:
    """Absolute names a source file imports (relative imports resolved)."""
    package = path.relative_to(SRC.parent).parent.parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


CODECS = sorted(p for folder in ("protocol", "encoders") for p in (SRC / folder).glob("*.py"))


@pytest.mark.parametrize("path", CODECS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_codecs_are_sans_io(path: Path) -> None:
    """Protocol and encoder modules take bytes or objects and return them: no I/O."""
    forbidden = ("aiohttp", "asyncio", "socket", "nexus.providers", "nexus.engine",
                 "nexus.server", "nexus.stream")  # fmt: skip
    for name in _imports(path):
        assert not name.startswith(forbidden), f"{path.name} imports {name}"
