"""The server's endpoints, one module per surface, each a tuple of Route declarations; ROUTES is
the table create_app serves and the replica router reads (a route that declares `prompt` is
routed prefix-aware). An endpoint is one function and one Route in one of these modules."""
from . import openai, operations, page, tokenizer
from .base import Route, find_route

ROUTES: tuple[Route, ...] = (*openai.ROUTES, *operations.ROUTES, *tokenizer.ROUTES, *page.ROUTES)

__all__ = ["ROUTES", "Route", "find_route"]
