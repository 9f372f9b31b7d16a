"""HTTP route handlers: parse, negotiate, call the engine, hand the stream to the pump."""
