"""The server's endpoints, one module per surface, each a tuple of Route declarations; ROUTES is
the table create_app serves and the replica router reads (a route that declares `prompt` is
routed prefix-aware). An endpoint is one function and one Route in one of these modules."""
from . import anthropic, llama_cpp, ollama, openai, operations, page, responses, tokenizer
from .base import Route, find_route

# The API families, by the names their clients know them
FAMILIES: tuple[tuple[str, tuple[Route, ...]], ...] = (
    ("OpenAI", openai.ROUTES + responses.ROUTES), ("Anthropic", anthropic.ROUTES), ("llama.cpp", llama_cpp.ROUTES),
    ("Ollama", ollama.ROUTES), ("vLLM's tokenizer", tokenizer.ROUTES),
    ("operations", operations.ROUTES), ("the chat page", page.ROUTES))
ROUTES: tuple[Route, ...] = tuple(r for _, routes in FAMILIES for r in routes)


def served_families(routes: tuple[Route, ...] = ROUTES) -> str:
    """What a 404 lists: each family served, with its routes."""
    parts = []
    for name, family in FAMILIES:
        served = [r for r in family if r in routes]
        if served:
            parts.append(f"{name} ({', '.join(f'{r.method} {r.path}' for r in served)})")
    return "; ".join(parts)


__all__ = ["FAMILIES", "ROUTES", "Route", "find_route", "served_families"]
