"""Engine outputs in OpenAI's shapes: logprobs (completions' and chat's), usage, SSE lines."""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

from ..sampling import Logprob
from ..tokenizer import UNICODE_TO_BYTE, TokenizerLike

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM use this floor too


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def sse_bodies(events: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The JSON bodies of a stream of sse() events (the closing [DONE] left out): what another
    API family's route reshapes an OpenAI stream from."""
    async for event in events:
        data = event.removeprefix("data: ").strip()
        if data != "[DONE]":
            yield json.loads(data)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


class TokenText:
    """Each token's own text and bytes, as logprobs report them (cached: the same few thousand
    tokens come up again and again)."""

    def __init__(self, tokenizer: TokenizerLike):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        s = self._text.get(token)
        if s is None:
            s = self._text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return s

    def bytes(self, token: int) -> list[int]:
        """The token's UTF-8 bytes. A token holding part of a character decodes to U+FFFD; its
        true bytes come from the vocabulary entry (byte-level BPE letters, or <0xXX>)."""
        s = self.text(token)
        if "\ufffd" in s:
            piece = self.tokenizer.id_to_token(token)
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return [int(m.group(1), 16)]
            if piece and all(c in UNICODE_TO_BYTE for c in piece):
                return [UNICODE_TO_BYTE[c] for c in piece]
        return list(s.encode("utf-8"))


def _sampled(token_ids: list[int], masks: list[int], logprobs: list[dict[int, Logprob]] | None):
    """(token, its logprob entry) for each sampled token; forced tokens (tool output, mask 0) have
    no entry, as the model did not choose them."""
    entries = iter(logprobs or [])
    for i, token in enumerate(token_ids):
        sampled = masks[i] if i < len(masks) else 1
        yield token, (next(entries, None) if sampled else None)


class CompletionLogprobs:
    """Completions' {tokens, token_logprobs, top_logprobs, text_offset}, built chunk by chunk
    (the offset runs on across chunks of one choice)."""

    def __init__(self, tt: TokenText, offset: int = 0):
        self.tt, self.offset = tt, offset

    def prompt(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None] | None) -> dict:
        """Echoed prompt tokens with their logprobs (the first has none: nothing predicts it), or
        all None when the engine computed none."""
        out = self._empty()
        for j, token in enumerate(token_ids):
            s = self.tt.text(token)
            entry = logprobs[j] if logprobs is not None and j < len(logprobs) else None
            out["tokens"].append(s)
            out["token_logprobs"].append(None if entry is None else _lp(entry[token].logprob))
            out["top_logprobs"].append(None if entry is None else self._top(entry))
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    def _top(self, entry: dict[int, Logprob]) -> dict[str, float]:
        top: dict[str, float] = {}
        for i, lp in sorted(entry.items(), key=lambda kv: kv[1].rank):  # the same text twice: keep the likelier
            top.setdefault(self.tt.text(i), _lp(lp.logprob))
        return top

    def add(self, token_ids: list[int], masks: list[int], logprobs) -> dict:
        out = self._empty()
        for token, entry in _sampled(token_ids, masks, logprobs):
            s = self.tt.text(token)
            if entry is not None:
                out["tokens"].append(s)
                out["token_logprobs"].append(_lp(entry[token].logprob))
                out["top_logprobs"].append(self._top(entry))
                out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    @staticmethod
    def _empty() -> dict:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    @staticmethod
    def join(parts: list[dict]) -> dict:
        out = CompletionLogprobs._empty()
        for p in parts:
            for k in out:
                out[k].extend(p[k])
        return out


def chat_logprobs(tt: TokenText, token_ids: list[int], masks: list[int], logprobs, top_n: int) -> list[dict]:
    """Chat's logprobs.content entries: {token, logprob, bytes, top_logprobs: [top_n of the same]}."""
    content = []
    for token, entry in _sampled(token_ids, masks, logprobs):
        if entry is None:
            continue
        ranked = sorted(((i, lp) for i, lp in entry.items() if lp.rank <= top_n), key=lambda kv: kv[1].rank)
        content.append({
            "token": tt.text(token), "logprob": _lp(entry[token].logprob), "bytes": tt.bytes(token),
            "top_logprobs": [{"token": tt.text(i), "logprob": _lp(lp.logprob), "bytes": tt.bytes(i)}
                             for i, lp in ranked[:top_n]],
        })
    return content


def vllm_prompt_logprobs(tt: TokenText, token_ids: list[int], logprobs: list[dict[int, Logprob] | None] | None
                         ) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and the top alternatives asked for."""
    if logprobs is None:
        return None
    return [None if entry is None else {str(i): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                                 "decoded_token": tt.text(i)}
                                        for i, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)}
            for entry in logprobs]
