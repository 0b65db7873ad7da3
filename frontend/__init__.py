"""Frontends: OpenAI-compatible HTTP and gRPC servers over any EngineHandle."""
