"""churon's OpenAI-compatible HTTP server: `churon serve`, or create_app() for an ASGI server of your own."""

from churon.server.app import create_app

__all__ = ["create_app"]
