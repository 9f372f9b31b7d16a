"""An integrator's encoder, imported by ``[encoders]`` specs in test_registry.py."""

from __future__ import annotations

from nexus.encoders import Encoder
from nexus.events import StreamEvent


class CustomEncoder(Encoder):
    """``TYPE\\n`` per event; relies on the base class for start, error and end."""

    media_type = "application/x-custom"
    aliases = ("custom", "Cust")

    def encode(self, event: StreamEvent) -> bytes:
        return type(event).type.encode() + b"\n"

    def heartbeat(self) -> bytes:
        return b"~\n"


class OtherEncoder(CustomEncoder):
    """The same frames under another media type (its aliases inherited)."""

    media_type = "application/x-other"


class NDJSONReplacement(CustomEncoder):
    """An integrator's encoder for a built-in media type."""

    media_type = "application/x-ndjson"


class Holder:
    """For a dotted ``module:Outer.Inner`` spec."""

    Encoder = CustomEncoder


NOT_AN_ENCODER = "a string"


class PlainClass:
    """A class that is not an Encoder subclass."""
