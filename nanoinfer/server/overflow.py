"""What happens when a prompt outgrows the context window, as the caller chooses; by default
nothing is cut and the request is a 400 giving both numbers (serving.check_window).

- `truncate_prompt_tokens` (vLLM's, completions and chat): the prompt's last k tokens are kept;
  -1 keeps as many as the window leaves beside max_tokens (the request's, else one token).
- `"truncation": "auto"` (chat; the name and meaning of OpenAI's Responses API): the oldest
  turns after the system prompt are dropped, whole (a turn: a user message and the replies
  and tool results after it), until the prompt and max_tokens fit; the last turn always
  stays, so a chat whose system prompt and last turn alone do not fit is still a 400.

Either way the response says what was cut (serving.py: the X-Truncated-* headers)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from .protocol import APIError

TRUNCATED_TOKENS_HEADER = "X-Truncated-Prompt-Tokens"
TRUNCATED_MESSAGES_HEADER = "X-Truncated-Messages"


def prompt_keep(truncate: int | None, max_model_len: int, max_tokens: int | None) -> int | None:
    """How many of a prompt's last tokens truncate_prompt_tokens keeps (None: all)."""
    if truncate is None:
        return None
    if truncate == -1:
        return max(1, max_model_len - (max_tokens or 1))
    if truncate < 1 or truncate > max_model_len:
        raise APIError(f"truncate_prompt_tokens={truncate}: give 1 to the context window ({max_model_len}) tokens "
                       "to keep, or -1 for as many as fit", "truncate_prompt_tokens", code="invalid_value")
    return truncate


def keep_last(ids: list[int], keep: int | None) -> tuple[list[int], int]:
    """ids cut to their last `keep` tokens (None: all), and how many were cut."""
    if keep is None or len(ids) <= keep:
        return ids, 0
    return ids[-keep:], len(ids) - keep


def turn_starts(messages: list[dict]) -> tuple[int, list[int]]:
    """(the end of the leading system/developer messages, where each turn after them starts);
    the first turn starts right after the system prompt, each other one at a user message."""
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    starts = [head] + [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]
    return head, starts if head < len(messages) else []


async def fit_chat(messages: list[dict], encode: Callable[[list[dict]], Awaitable[list[int]]], max_model_len: int,
                   max_tokens: int | None, param: str) -> tuple[list[int], int]:
    """The prompt ids with the fewest oldest turns dropped so that they and max_tokens (else one
    token) fit the window, and how many messages were dropped."""
    need = max_tokens or 1
    ids = await encode(messages)
    if len(ids) + need <= max_model_len:
        return ids, 0
    head, starts = turn_starts(messages)
    last = ids
    if len(starts) >= 2:  # the number of turns dropped, by bisection: more dropped never makes a prompt longer
        lo, hi, best = 1, len(starts) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            candidate = await encode(messages[:head] + messages[starts[mid]:])
            if len(candidate) + need <= max_model_len:
                best, hi = (candidate, starts[mid] - head), mid - 1
            else:
                last, lo = candidate, mid + 1
        if best is not None:
            return best
    room = f"{param}={max_tokens}" if max_tokens else "one token to generate"
    raise APIError(f"this model's context window is {max_model_len} tokens, but the system prompt and the last turn "
                   f"alone are {len(last)} tokens, and {room} makes {len(last) + need}: truncation drops no more",
                   param, code="context_length_exceeded")
