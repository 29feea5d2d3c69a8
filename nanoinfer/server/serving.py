"""/v1/completions, /v1/chat/completions and /v1/embeddings: request -> prompts and
SamplingParams -> the engine thread -> OpenAI's response or chunk stream. The other API
families' routes translate their requests into these.

Nothing here runs model code: prompts are tokenized on the event loop (a thread for long ones)
and the engine runs on its own thread behind AsyncEngine. Every way a request can end early
(client gone, handler cancelled at shutdown) closes the engine's async iterator, which aborts
the request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..engine.async_engine import AsyncEngine
from ..engine.outputs import RequestOutput, StreamDelta
from ..errors import InvalidRequestError, RequestFailedError
from ..sampling import SamplingParams, StructuredOutputsParams
from ..tokenizer import TokenizerLike
from ..tokenizer.fim import fim_prompt, fim_tokens
from ..tokenizer.tool_prompt import with_tools
from .access import AccessPolicy
from .constraints import request_constraint
from .outputs import CompletionLogprobs, TokenText, chat_logprobs, sse, usage, vllm_prompt_logprobs
from .overflow import TRUNCATED_MESSAGES_HEADER, TRUNCATED_TOKENS_HEADER, fit_chat, keep_last, prompt_keep
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingFields,
    check_fields,
    message_dicts,
)
from .tool_calls import ToolCallParser, parse_tool_calls

logger = logging.getLogger("nanoinfer.server")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default; chat's default is "until the context is full"
T = TypeVar("T")
LONG_TEXT = 20_000  # characters: tokenize in a thread past this, so the event loop stays responsive


@dataclass
class ServerConfig:
    model_name: str
    max_n: int = 16
    max_tokens_limit: int | None = None  # None: only the context window limits max_tokens
    max_request_bytes: int = 1 << 20
    max_prompts: int = 64  # prompts in one /v1/completions request
    shutdown_timeout: float = 5.0  # seconds in-flight requests get to finish on SIGINT/SIGTERM
    header_timeout: float = 10.0  # seconds a connection gets to send a request's headers
    client_read_timeout: float = 30.0  # seconds a stream may go unread before its request is aborted
    access: AccessPolicy = field(default_factory=AccessPolicy)  # keys, hosts, origins (access.py); default: open
    replica_index: int | None = None  # behind --replicas, this replica's: in its stored responses' ids (replicas.py)
    embedding_pooling: str = "last"  # how /v1/embeddings pools a text's hidden states (SamplingParams.pooling)


class ClientGone(Exception):
    """The client closed the connection before a non-streaming response was ready."""


@dataclass
class Reply:
    """A response: a JSON body or a stream of SSE lines, and headers of its own."""
    content: dict | AsyncIterator[str]
    headers: dict[str, str] = field(default_factory=dict)


RELAXED_HEADER = "X-Structured-Output-Relaxed"  # schema keywords decoding did not enforce (checked after)


@dataclass
class Prompt:
    text: str | None
    ids: list[int]
    cut: int = 0  # tokens truncate_prompt_tokens took off its start


class Serving:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.tt = TokenText(self.tokenizer)
        # No token spells more characters than this (+1: a SentencePiece token's space), so a
        # text longer than max_model_len times it cannot fit, and is refused without tokenizing.
        tok = self.tokenizer
        self.max_token_chars = 1 + max(len(tok.decode([i], skip_special_tokens=False)) for i in range(tok.vocab_size))

    # --- shared checks ----------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(f"the model {name!r} does not exist; this server serves {self.config.model_name!r}",
                           "model", status=404, code="model_not_found")

    def template_input(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        return template_input(self.tokenizer, messages, tools)

    def check_window(self, prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """The prompt and max_tokens together must fit the context window (OpenAI's rule)."""
        if max_tokens is not None and prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(f"this model's context window is {self.max_model_len} tokens, but {prompt_tokens} prompt "
                           f"tokens and {param}={max_tokens} make {prompt_tokens + max_tokens}: shorten the prompt or "
                           f"lower {param}", param, code="context_length_exceeded")

    def check_prompt_chars(self, chars: int, param: str) -> None:
        if chars > self.max_model_len * self.max_token_chars:
            raise APIError(f"the prompt is {chars} characters: at least {chars // self.max_token_chars} tokens, more "
                           f"than the context window of {self.max_model_len}", param, code="context_length_exceeded")

    def validate_prompt(self, ids: list[int], param: str, scoring: bool = False) -> None:
        try:
            self.engine.engine.validate_prompt(ids, scoring=scoring)
        except InvalidRequestError as e:
            raise APIError(str(e), param, code=e.code or "invalid_value") from None

    def sampling_params(self, req: SamplingFields, *, max_tokens: int | None, max_tokens_param: str,
                        logprobs: int | None, logprobs_param: str,
                        default_max_tokens: int | None = None, prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """`max_tokens` as the request gave it (None: absent); the default is clamped to the limit."""
        cfg = self.config
        if req.n > cfg.max_n:
            raise APIError(f"n={req.n} is over this server's limit of {cfg.max_n}", "n", code="invalid_value")
        limit = cfg.max_tokens_limit
        if max_tokens is not None and limit is not None and max_tokens > limit:
            raise APIError(f"{max_tokens_param}={max_tokens} is over this server's limit of {limit}",
                           max_tokens_param, code="invalid_value")
        if max_tokens is None:
            max_tokens = default_max_tokens if limit is None else min(default_max_tokens or limit, limit)
        opt = lambda value, default: default if value is None else value  # noqa: E731
        try:
            return SamplingParams(
                n=req.n, temperature=opt(req.temperature, 1.0), top_p=opt(req.top_p, 1.0), top_k=opt(req.top_k, 0),
                min_p=opt(req.min_p, 0.0), presence_penalty=opt(req.presence_penalty, 0.0),
                frequency_penalty=opt(req.frequency_penalty, 0.0),
                repetition_penalty=opt(req.repetition_penalty, 1.0), seed=req.seed, max_tokens=max_tokens,
                min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                structured_outputs=structured_outputs,
                prompt_logprobs=req.prompt_logprobs if req.prompt_logprobs is not None else prompt_logprobs,
                logit_bias=req.logit_bias,
            )
        except InvalidRequestError as e:
            # SamplingParams' field names -> this request's: "max_tokens=0 ..." -> "max_completion_tokens=0 ..."
            name = e.param
            param = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(name, name)
            message = str(e)
            if name and param != name and message.startswith(name):
                message = param + message[len(name):]
            raise APIError(message, param, code=e.code or "invalid_value") from None

    async def constraint(self, req: SamplingFields, tools: list[dict] | None = None
                         ) -> tuple[StructuredOutputsParams | None, dict[str, str]]:
        """The request's structured-output constraint, compiled here in a worker thread (cached
        by its text), so that the engine loop never waits on a compile; and the header naming
        the schema keywords relaxed for decoding, if any."""
        found = request_constraint(req, self.tokenizer, tools)
        if found is None:
            return None, {}
        field_name, spec = found
        try:
            compiled = await asyncio.to_thread(self.engine.engine.structured.compile, spec)
        except InvalidRequestError as e:  # named as the request carried it
            param = {"structured_outputs": e.param, "response_format": "response_format.json_schema.schema"
                     }.get(field_name)
            raise APIError(str(e), param or field_name, code=e.code) from None
        check = getattr(compiled, "check", None)
        return spec, ({RELAXED_HEADER: ", ".join(check.relaxed)} if check is not None else {})

    async def encode(self, fn, *args, **kwargs) -> list[int]:
        text_len = sum(len(a) if isinstance(a, str) else _chat_chars(a) for a in args if isinstance(a, (str, list)))
        if text_len > LONG_TEXT:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    # --- the engine -------------------------------------------------------------------
    async def run(self, prompts: list[Prompt], params: SamplingParams, request_id: str,
                  priority: int = 0) -> AsyncIterator[tuple[int, StreamDelta | RequestOutput]]:
        """All prompts' outputs as they come, tagged with the prompt's index. Closing this
        iterator (or cancelling its consumer) aborts every request still running."""
        # Bounded: a consumer that stops reading stops the pumps, so the engine sees its reader fall
        # behind (and pauses the request) instead of this queue growing.
        queue: asyncio.Queue = asyncio.Queue(maxsize=16)
        done = object()

        async def pump(i: int, prompt: Prompt) -> None:
            try:
                async with aclosing(self.engine.generate(prompt.ids, params, f"{request_id}-{i}",
                                                         prompt.text, priority)) as stream:
                    async for item in stream:
                        await queue.put((i, item))
                await queue.put((i, done))
            except RuntimeError as e:  # the engine is shutting down
                await queue.put((i, APIError(str(e), status=503, type="server_error")))
            except Exception as e:  # refused (400), or failed inside the engine (500): the consumer raises it
                await queue.put((i, as_api_error(e)))

        if not self.engine.thread.is_alive():
            raise APIError("the engine is not running", status=503, type="server_error")
        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()  # a pump still waiting on the engine aborts its request

    async def collect(self, request, prompts: list[Prompt], params: SamplingParams,
                      request_id: str, priority: int = 0) -> list[RequestOutput]:
        """Wait for the final outputs, or raise ClientGone as soon as the client disconnects
        (its requests are then aborted, so no more tokens are computed for it)."""
        finals: list[RequestOutput | None] = [None] * len(prompts)

        async def gather() -> None:
            async with aclosing(self.run(prompts, params, request_id, priority)) as stream:
                async for i, item in stream:
                    if isinstance(item, RequestOutput):
                        finals[i] = item

        await unless_gone(request, gather())
        return finals  # type: ignore[return-value]

    # --- /v1/completions --------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request, until_full: bool = False):
        """until_full: without max_tokens, generate until the window is full (llama.cpp's n_predict -1)
        rather than OpenAI's 16."""
        self.check_model(req.model)
        check_fields(req, "/v1/completions")
        keep = prompt_keep(req.truncate_prompt_tokens, self.max_model_len, req.max_tokens)
        if req.suffix is not None:
            if keep is not None:
                raise APIError("truncate_prompt_tokens with suffix: cutting a fill-in-the-middle prompt would cut its "
                               "markers; shorten the prefix instead", "truncate_prompt_tokens", code="invalid_value")
            prompts = [await self.fim_prompt(req)]
        else:
            prompts = await self.completion_prompts(req.prompt, req.parse_special, keep)
        cut = sum(p.cut for p in prompts)
        if req.max_tokens == 0 and not (req.echo or req.prompt_logprobs is not None):
            raise APIError("max_tokens=0 generates nothing: it is for scoring a prompt, with echo (and logprobs) or "
                           "prompt_logprobs", "max_tokens", code="invalid_value")
        # echo with logprobs scores the prompt's tokens too; max_tokens 0 scores only them
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else 0 if req.max_tokens == 0 else None
        # OpenAI's default of 16, within what the window leaves
        room = self.max_model_len - max(len(p.ids) for p in prompts)
        default = room if until_full else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        spec, headers = await self.constraint(req)
        if cut:
            headers[TRUNCATED_TOKENS_HEADER] = str(cut)
        params = self.sampling_params(req, max_tokens=req.max_tokens, max_tokens_param="max_tokens",
                                      default_max_tokens=default, logprobs=req.logprobs,
                                      logprobs_param="logprobs", prompt_logprobs=prompt_logprobs,
                                      structured_outputs=spec)
        for p in prompts:
            self.check_window(len(p.ids), params.max_tokens, "max_tokens")
        if req.echo:
            for p in prompts:
                if p.text is None:
                    p.text = self.tokenizer.decode(p.ids, skip_special_tokens=False)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return Reply(self.stream_completions(req, prompts, params, rid, created), headers)
        finals = await self.collect(request, prompts, params, rid, req.priority)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                text, lp = c.text, None
                if params.logprobs is not None:
                    builder = CompletionLogprobs(self.tt)
                    parts = [builder.prompt(out.prompt_token_ids, out.prompt_logprobs)] if req.echo else []
                    lp = CompletionLogprobs.join(parts + [builder.add(c.token_ids, c.token_masks, c.logprobs)])
                if req.echo:
                    text = prompts[i].text + text
                choice = {"index": i * params.n + c.index, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(self.tt, out.prompt_token_ids, out.prompt_logprobs)
                if c.violations:
                    choice["structured_output_violations"] = c.violations
                choices.append(choice)
        return Reply({
            "id": rid, "object": "text_completion", "created": created, "model": self.config.model_name,
            "choices": choices, "usage": self._usage(finals),
        }, headers)

    async def fim_prompt(self, req: CompletionRequest) -> Prompt:
        """Fill in the middle: the prompt is the text before, `suffix` the text after."""
        if not isinstance(req.prompt, str):
            raise APIError("with suffix, prompt must be one string (the text before the middle)", "prompt",
                           code="invalid_type")
        fim = fim_tokens(self.tokenizer)
        if fim is None:
            raise APIError("suffix: this model's vocabulary has no fill-in-the-middle tokens, so it cannot fill in",
                           "suffix", code="unsupported_value")
        self.check_prompt_chars(len(req.prompt) + len(req.suffix), "prompt")
        ids = await self.encode(fim_prompt, self.tokenizer, fim, req.prompt, req.suffix)
        self.validate_prompt(ids, "prompt")
        return Prompt(req.prompt, ids)

    async def completion_prompts(self, prompt, parse_special: bool = True, keep: int | None = None,
                                 param: str = "prompt", scoring: bool = False) -> list[Prompt]:
        """The prompts' ids; with `keep`, each cut to its last `keep` tokens (its text then dropped).
        scoring: nothing is generated after them, so a prompt may fill the window."""
        if isinstance(prompt, str) or prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise APIError(f"{param} must not be empty", param)
        if len(prompt) > self.config.max_prompts:
            raise APIError(f"{len(prompt)} prompts is over this server's limit of {self.config.max_prompts}",
                           param)
        out = []
        for p in prompt:
            if isinstance(p, str):
                if keep is None:
                    self.check_prompt_chars(len(p), param)
                out.append(Prompt(p, await self.encode(self.tokenizer.encode, p, parse_special=parse_special)))
            else:
                out.append(Prompt(None, list(p)))
            ids, cut = keep_last(out[-1].ids, keep)
            if cut:
                out[-1] = Prompt(None, ids, cut)
            self.validate_prompt(out[-1].ids, param, scoring)
        return out

    # --- /v1/embeddings ---------------------------------------------------------------
    @property
    def embedding_size(self) -> int:
        return self.engine.engine.model_config.hidden_size

    async def embed(self, request, inputs, keep: int | None = None, param: str = "input",
                    pooling: str | None = None, dimensions: int | None = None) -> tuple[list[list[float]], int]:
        """Each input's L2-normalised pooled vector, and the prompt tokens they took: one
        prefill-only request per input through the engine's scheduler, batched with whatever
        else runs (a vector is the same in any batch). dimensions: only the model's own."""
        if dimensions is not None and dimensions != self.embedding_size:
            raise APIError(f"dimensions={dimensions}: this model's embeddings have {self.embedding_size} "
                           "dimensions and cannot be shortened", "dimensions", code="unsupported_value")
        prompts = await self.completion_prompts(inputs, keep=keep, param=param, scoring=True)
        params = SamplingParams(max_tokens=0, temperature=0, pooling=pooling or self.config.embedding_pooling)
        finals = await self.collect(request, prompts, params, f"embd-{uuid.uuid4().hex}")
        return [out.embedding for out in finals], sum(len(p.ids) for p in prompts)

    async def embeddings(self, req: EmbeddingRequest, request) -> Reply:
        self.check_model(req.model)
        check_fields(req, "/v1/embeddings")
        vectors, tokens = await self.embed(request, req.input, prompt_keep(req.truncate_prompt_tokens,
                                                                             self.max_model_len, 0),
                                           dimensions=req.dimensions)
        data = [{"object": "embedding", "index": i,
                 "embedding": v if req.encoding_format == "float" else
                 base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()}
                for i, v in enumerate(vectors)]
        return Reply({"object": "list", "data": data, "model": self.config.model_name,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def stream_completions(self, req: CompletionRequest, prompts: list[Prompt], params: SamplingParams,
                                 rid: str, created: int) -> AsyncIterator[str]:
        n = params.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.config.model_name}
        builders: dict[int, CompletionLogprobs] = {}
        started: set[int] = set()
        finals: list[RequestOutput | None] = [None] * len(prompts)

        def chunk(index: int, text: str, lp, finish_reason, prompt_lp=None, violations=None, stop_reason=None) -> str:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
            if prompt_lp is not None:
                choice["prompt_logprobs"] = prompt_lp
            if violations:
                choice["structured_output_violations"] = violations
            body = {**base, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return sse(body)

        try:
            async with aclosing(self.run(prompts, params, rid, req.priority)) as stream:
                async for i, item in stream:
                    if isinstance(item, RequestOutput):
                        finals[i] = item
                        continue
                    index = i * n + item.index
                    text, lp = item.text, None
                    builder = builders.setdefault(index, CompletionLogprobs(self.tt))
                    echo_lp = prompt_lp = None
                    if index not in started:  # its first chunk: the echoed prompt, and the prompt's logprobs
                        started.add(index)
                        if req.echo:
                            text = prompts[i].text + text
                            if params.logprobs is not None:
                                echo_lp = builder.prompt(prompts[i].ids, item.prompt_logprobs)
                        if req.prompt_logprobs is not None:
                            prompt_lp = vllm_prompt_logprobs(self.tt, prompts[i].ids, item.prompt_logprobs)
                    if params.logprobs is not None and item.token_ids:
                        lp = builder.add(item.token_ids, item.token_masks, item.logprobs)
                    if echo_lp is not None:
                        lp = CompletionLogprobs.join([echo_lp, lp] if lp else [echo_lp])
                    if text or lp or item.finished or prompt_lp is not None:
                        yield chunk(index, text, lp, item.finish_reason if item.finished else None, prompt_lp,
                                    item.violations, item.stop_reason)
            if include_usage:
                yield sse({**base, "choices": [], "usage": self._usage(finals)})
        except Exception as e:  # whatever went wrong, the stream ends with an error event and [DONE]
            yield sse(as_api_error(e).body())
        yield sse("[DONE]")

    # --- /v1/chat/completions ---------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request):
        self.check_model(req.model)
        check_fields(req, "/v1/chat/completions")
        if not req.messages:
            raise APIError("messages must be a non-empty list", "messages")
        messages = message_dicts(req.messages)
        if req.truncation != "auto" and req.truncate_prompt_tokens is None:  # (cut below: tokenized whole)
            self.check_prompt_chars(_chat_chars(messages), "messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise APIError("tool_choice needs tools", "tool_choice")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
            if name not in {t["function"]["name"] for t in tools}:
                raise APIError(f"tool_choice names a function that is not in tools: {name!r}", "tool_choice")
        if choice == "none":
            tools = None  # the model is not told about tools, so it writes a plain reply
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens, mt_param = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, mt_param = req.max_tokens, "max_tokens"
        if max_tokens == 0 and req.prompt_logprobs is None:
            raise APIError(f"{mt_param}=0 generates nothing: it is for scoring the prompt, with prompt_logprobs",
                           mt_param, code="invalid_value")
        spec, headers = await self.constraint(req, tools)
        params = self.sampling_params(req, max_tokens=max_tokens, max_tokens_param=mt_param,
                                      logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                      logprobs_param="top_logprobs", structured_outputs=spec)
        if req.truncation == "auto":
            ids, dropped = await fit_chat(messages, lambda msgs: self.chat_ids(req, msgs, tools), self.max_model_len,
                                          max_tokens, mt_param)
            if dropped:
                headers[TRUNCATED_MESSAGES_HEADER] = str(dropped)
        else:
            ids = await self.chat_ids(req, messages, tools)
        ids, cut = keep_last(ids, prompt_keep(req.truncate_prompt_tokens, self.max_model_len, max_tokens))
        if cut:
            headers[TRUNCATED_TOKENS_HEADER] = str(cut)
        self.validate_prompt(ids, "messages")
        self.check_window(len(ids), max_tokens, mt_param)
        prompts = [Prompt(None, ids)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        parse_tools = tools is not None
        if req.stream:
            return Reply(self.stream_chat(req, prompts, params, rid, created, parse_tools), headers)
        (out,) = await self.collect(request, prompts, params, rid, req.priority)
        choices = []
        for c in out.outputs:
            message: dict = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if parse_tools:
                content, calls = parse_tool_calls(c.text)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [call.to_openai() for call in calls]}
                    finish_reason = "tool_calls"
            lp = None
            if params.logprobs is not None:
                lp = {"content": chat_logprobs(self.tt, c.token_ids, c.token_masks, c.logprobs, params.logprobs)}
            choice = {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish_reason,
                      "stop_reason": c.stop_reason}
            if c.violations:
                choice["structured_output_violations"] = c.violations
            choices.append(choice)
        body = {
            "id": rid, "object": "chat.completion", "created": created, "model": self.config.model_name,
            "choices": choices, "usage": self._usage([out]),
        }
        if req.prompt_logprobs is not None:  # vLLM's place for it
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tt, out.prompt_token_ids, out.prompt_logprobs)
        return Reply(body, headers)

    async def chat_ids(self, req: ChatCompletionRequest, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The prompt ids of a chat request's messages (its template options, parse_special, ...)."""
        rendered, template_tools = self.template_input(messages, tools)
        try:
            return await self.encode(self.tokenizer.encode_chat, rendered, tools=template_tools,
                                     parse_special=req.parse_special,
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     **(req.chat_template_kwargs or {}))
        except InvalidRequestError as e:
            raise APIError(str(e), e.param or "messages", code=e.code or "invalid_value") from None
        except TypeError as e:  # chat_template_kwargs tried to set messages/tools/add_generation_prompt
            raise APIError(f"chat_template_kwargs: {e}", "chat_template_kwargs", code="invalid_value") from None

    async def stream_chat(self, req: ChatCompletionRequest, prompts: list[Prompt], params: SamplingParams,
                          rid: str, created: int, parse_tools: bool) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.config.model_name}
        want_lp = params.logprobs is not None
        parsers = {i: ToolCallParser() for i in range(params.n)} if parse_tools else {}
        pending_lp: dict[int, list] = {i: [] for i in range(params.n)}  # logprobs of held-back text
        num_calls = dict.fromkeys(range(params.n), 0)
        finished: set[int] = set()
        out: RequestOutput | None = None

        def chunk(index: int, delta: dict, finish_reason: str | None = None, violations=None, stop_reason=None) -> str:
            lp = None
            if want_lp and pending_lp[index]:
                lp = {"content": pending_lp[index]}
                pending_lp[index] = []
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
            if violations:
                choice["structured_output_violations"] = violations
            body = {**base, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return sse(body)

        def events_to_chunks(index: int, events) -> list[str]:
            chunks = []
            for kind, value in events:
                if kind == "content":
                    chunks.append(chunk(index, {"content": value}))
                else:
                    call = value.to_openai(index=num_calls[index])
                    num_calls[index] += 1
                    chunks.append(chunk(index, {"tool_calls": [call]}))
            return chunks

        def finish(index: int, reason: str | None, violations: list[str] | None, stop_reason=None) -> list[str]:
            finished.add(index)
            chunks = events_to_chunks(index, parsers[index].finish()) if parse_tools else []
            if num_calls[index] and reason in ("stop", "length"):
                reason = "tool_calls"
            return chunks + [chunk(index, {}, reason, violations, stop_reason)]

        try:
            for i in range(params.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async with aclosing(self.run(prompts, params, rid, req.priority)) as stream:
                async for _, item in stream:
                    if isinstance(item, RequestOutput):
                        out = item
                        for c in item.outputs:  # a sample that ended without a final delta
                            if c.index not in finished:
                                for s in finish(c.index, c.finish_reason, c.violations, c.stop_reason):
                                    yield s
                        continue
                    index = item.index
                    if want_lp and item.token_ids:
                        pending_lp[index] += chat_logprobs(self.tt, item.token_ids, item.token_masks,
                                                           item.logprobs, params.logprobs)
                    if parse_tools:
                        chunks = events_to_chunks(index, parsers[index].feed(item.text))
                    else:
                        chunks = [chunk(index, {"content": item.text})] if item.text else []
                    for s in chunks:
                        yield s
                    if item.finished:
                        for s in finish(index, item.finish_reason, item.violations, item.stop_reason):
                            yield s
            if include_usage and out is not None:
                yield sse({**base, "choices": [], "usage": self._usage([out])})
        except Exception as e:  # whatever went wrong, the stream ends with an error event and [DONE]
            yield sse(as_api_error(e).body())
        yield sse("[DONE]")

    # --- helpers ----------------------------------------------------------------------
    @staticmethod
    def _usage(finals: list[RequestOutput | None]) -> dict:
        outs = [o for o in finals if o is not None]
        return usage(sum(len(o.prompt_token_ids) for o in outs),
                     sum(len(c.token_ids) for o in outs for c in o.outputs))


def template_input(tokenizer: TokenizerLike, messages: list[dict], tools: list[dict] | None
                   ) -> tuple[list[dict], list[dict] | None]:
    """What the chat template gets: the messages and tools as they are when it renders tools;
    else the tools written into the system message and the tool turns as text (tool_prompt.py)."""
    if tokenizer.native_tools:
        return messages, tools
    return with_tools(messages, tools), None


def _chat_chars(messages: list) -> int:
    return sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))


async def unless_gone(request, work: Coroutine[Any, Any, T]) -> T:
    """work's result, or ClientGone as soon as the client disconnects (work is then cancelled,
    which aborts the engine requests it waits on)."""
    task = asyncio.create_task(work)
    watch = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone()
        return task.result()
    finally:
        task.cancel()
        watch.cancel()


async def wait_for_disconnect(request) -> None:
    """Return when the client disconnects. The body has been read, so the next ASGI message
    is http.disconnect; waiting for it costs nothing, unlike polling is_disconnected()."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def as_api_error(e: Exception) -> APIError:
    """What the client is told: its own mistake (400), the failure of its request inside the engine
    (500; the engine logged it), or an unexpected error (500, logged here; the message names no internals)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(str(e), e.param, code=e.code)
    if isinstance(e, RequestFailedError):
        return APIError(str(e), status=500, type="server_error")
    logger.error("internal error", exc_info=e)
    return APIError(f"internal error: {type(e).__name__}", status=500, type="server_error")
