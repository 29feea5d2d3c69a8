"""The HTTP server: OpenAI-compatible API, metrics and a chat page (`nanoinfer serve`)."""
from .app import create_app, serve
from .serving import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve"]
