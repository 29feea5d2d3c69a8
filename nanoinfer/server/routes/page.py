"""The chat page at /: one self-contained HTML file (no CDN: this server loads nothing from outside)."""
from __future__ import annotations

from pathlib import Path

from fastapi.responses import Response

from .base import Route

_PAGE = (Path(__file__).parents[1] / "static" / "index.html").read_bytes()


async def index() -> Response:
    return Response(_PAGE, media_type="text/html; charset=utf-8")


ROUTES = (Route("GET", "/", index),)
