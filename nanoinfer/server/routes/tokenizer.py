"""/tokenize and /detokenize (vLLM's shapes): the model's tokenizer and chat template, no generation."""
from __future__ import annotations

from fastapi import Request

from ...errors import InvalidRequestError
from ..protocol import APIError, DetokenizeRequest, TokenizeRequest, message_dicts
from ..state import server_state
from ..wire import parse_body
from .base import Route


async def tokenize(request: Request) -> dict:
    s = server_state(request)
    serving, tokenizer = s.serving, s.serving.tokenizer
    req = await parse_body(request, TokenizeRequest, s.config.max_request_bytes)
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give either prompt or messages", "prompt")
    try:
        if req.prompt is not None:
            ids = await serving.encode(tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens,
                                       parse_special=req.parse_special is not False)
        else:
            if not req.messages:
                raise APIError("messages must be a non-empty list", "messages")
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            messages, tools = serving.template_input(message_dicts(req.messages), tools)
            ids = await serving.encode(tokenizer.encode_chat, messages,
                                       add_generation_prompt=req.add_generation_prompt, tools=tools,
                                       parse_special=req.parse_special is True, **(req.chat_template_kwargs or {}))
    except InvalidRequestError as e:
        raise APIError(str(e), e.param or ("prompt" if req.prompt is not None else "messages")) from None
    except TypeError as e:
        raise APIError(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}


async def detokenize(request: Request) -> dict:
    s = server_state(request)
    tokenizer = s.serving.tokenizer
    req = await parse_body(request, DetokenizeRequest, s.config.max_request_bytes)
    s.serving.check_model(req.model)
    bad = next((t for t in req.tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


ROUTES = (
    Route("POST", "/tokenize", tokenize),
    Route("POST", "/detokenize", detokenize),
)
