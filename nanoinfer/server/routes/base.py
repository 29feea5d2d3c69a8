"""A route: one endpoint as the app serves it and as the replica router sees it."""
from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from starlette.routing import compile_path


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # FastAPI's syntax: "/v1/models/{model_id:path}"
    endpoint: Callable[..., Awaitable[Any]]  # a FastAPI endpoint; it reaches the server through server_state(request)
    # A route that generates from a prompt declares how to read the prompt's text from the JSON
    # body: behind `--replicas` the router sends requests whose texts share a prefix to the same
    # replica, where that prefix's KV blocks are cached. None: the route does not generate.
    prompt: Callable[[dict], str] | None = None
    # A route whose request refers to state one replica holds (a stored response) declares how to
    # read that replica's index from the request's path and JSON body: behind `--replicas` the
    # router sends it there while that replica is alive. None (or the function returning None):
    # any replica will do.
    affinity: Callable[[str, dict], int | None] | None = None

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and _pattern(self.path).match(path) is not None


@cache
def _pattern(path: str) -> re.Pattern:
    return compile_path(path)[0]  # Starlette's own reading of the path, so the router matches as the app does


def find_route(routes: Sequence[Route], method: str, path: str) -> Route | None:
    return next((r for r in routes if r.matches(method, path)), None)
