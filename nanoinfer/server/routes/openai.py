"""OpenAI's API: /v1/completions, /v1/chat/completions (both generate), /v1/embeddings, /v1/models."""
from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import Response

from ..protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from ..serving import ClientGone, Serving
from ..state import server_state
from ..wire import parse_body, respond
from .base import Route


def completion_prompt(req: dict) -> str:
    """A completion's prompt; a list of prompts or token ids as its JSON text."""
    prompt = req.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def chat_prompt(req: dict) -> str:
    """A chat's messages in order, each as "<role>" and its content."""
    parts = []
    for m in req.get("messages") or []:
        if isinstance(m, dict):
            content = m.get("content")
            parts.append(f"<{m.get('role')}>" + (content if isinstance(content, str) else json.dumps(content)))
    return "".join(parts)


async def _generate(request: Request, body_model, serve) -> Response:
    """Read the body as body_model, run it through serve(serving, req, request), answer it
    (JSON or an event stream); a client gone before its answer gets 499."""
    s = server_state(request)
    req = await parse_body(request, body_model, s.config.max_request_bytes)
    try:
        return respond(await serve(s.serving, req, request), s.config.client_read_timeout)
    except ClientGone:
        return Response(status_code=499)


async def completions(request: Request) -> Response:
    return await _generate(request, CompletionRequest, Serving.completions)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, Serving.chat)


async def embeddings(request: Request) -> Response:
    return await _generate(request, EmbeddingRequest, Serving.embeddings)


def embedding_input(req: dict) -> str:
    inputs = req.get("input")
    return inputs if isinstance(inputs, str) else json.dumps(inputs)


def model_card(request: Request) -> dict:
    s = server_state(request)
    return {"id": s.config.model_name, "object": "model", "created": s.started, "owned_by": "nanoinfer",
            "max_model_len": s.serving.max_model_len,
            # native: the chat template lists tools; injected: the server writes them into the prompt
            "tool_calling": "native" if s.serving.tokenizer.native_tools else "injected",
            # /v1/embeddings: the served model's pooled, L2-normalised hidden states
            "embeddings": {"dimensions": s.serving.embedding_size, "pooling": s.config.embedding_pooling}}


async def models(request: Request) -> dict:
    return {"object": "list", "data": [model_card(request)]}


async def model(model_id: str, request: Request) -> dict:
    server_state(request).serving.check_model(model_id)
    return model_card(request)


ROUTES = (
    Route("POST", "/v1/completions", completions, prompt=completion_prompt),
    Route("POST", "/v1/chat/completions", chat_completions, prompt=chat_prompt),
    Route("POST", "/v1/embeddings", embeddings, prompt=embedding_input),
    Route("GET", "/v1/models", models),
    Route("GET", "/v1/models/{model_id:path}", model),
)
