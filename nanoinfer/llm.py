"""The offline Python API, shaped like vLLM's: LLM(model).generate(prompts, params)."""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from .distributed.sharding import shard_model
from .engine import EngineConfig, LLMEngine
from .engine.outputs import RequestOutput, StreamDelta
from .errors import InvalidRequestError
from .models.builder import load_model
from .sampling import SamplingParams

# "auto": a GGUF's weights as stored, run by the block-format kernels; other formats float32.
DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

# A prompt: text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts.
Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | Path | None = None, *, dtype: str = "auto", device: str = "cpu",
                 model_overrides: dict | None = None, **engine_args):
        """engine_args: the fields of EngineConfig (max_model_len, kv_cache_memory, block_size,
        max_num_seqs, max_num_batched_tokens, enable_prefix_caching, enable_tools, kv_cache_dtype,
        attention_backend: a registered name, or "auto").
        model_overrides: nanochat checkpoint selection and constants (see loaders.load_model)."""
        if dtype not in DTYPES:
            raise InvalidRequestError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")
        try:
            config = EngineConfig(**engine_args)
        except TypeError as e:
            raise InvalidRequestError(str(e)) from None
        transform = None
        if config.tensor_parallel_size > 1:  # this process is rank 0: it keeps the first share
            tp = config.tensor_parallel_size
            transform = lambda model, cfg: shard_model(model, cfg, 0, tp)  # noqa: E731
        self.loaded = load_model(model, dtype=DTYPES[dtype], device=device, overrides=model_overrides,
                                 transform=transform)
        self.engine = LLMEngine(self.loaded, config)
        self.tokenizer = self.loaded.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # --- prompts ----------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt, parse_special: bool = True) -> tuple[str | None, list[int]]:
        """Text prompts are the caller's own: special-token text in them ("<|fim_prefix|>") is parsed."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, parse_special=parse_special)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"], parse_special=parse_special)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    @staticmethod
    def _as_list(prompts) -> list:
        # A flat list of ints is one tokenized prompt, not many.
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            return [prompts]
        return list(prompts)

    def _params_list(self, params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts")
        return list(params)

    def _submit(self, prompt: Prompt, params: SamplingParams, parse_special: bool = True, priority: int = 0) -> str:
        text, ids = self._prompt_ids(prompt, parse_special)
        rid = str(next(self._ids))
        self.engine.add_request(rid, ids, params, prompt=text, priority=priority)
        return rid

    # --- generation -------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, parse_special: bool = True,
                 priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Run the prompts together (continuous batching) and return one output per prompt,
        in order. use_tqdm: a progress bar of finished requests on stderr. parse_special=False:
        special-token text in text prompts stays plain text. priority: one per prompt, vLLM's
        (lower first), read by the "priority" scheduling policy."""
        plist = self._as_list(prompts)
        params = self._params_list(sampling_params, len(plist))
        priorities = [0] * len(plist) if priority is None else [int(p) for p in priority]
        if len(priorities) != len(plist):
            raise InvalidRequestError(f"{len(priorities)} priorities for {len(plist)} prompts")
        # Validate every prompt before any runs, so one bad prompt loses nothing.
        prepared = [self._prompt_ids(p, parse_special) for p in plist]
        for (_, ids), p in zip(prepared, params):
            self.engine.validate_request(ids, p)
        rids = [self._submit({"prompt": t, "prompt_token_ids": ids}, p, priority=rank)
                for (t, ids), p, rank in zip(prepared, params, priorities)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(rids), desc="requests", unit="req")
        try:
            while self.engine.has_unfinished():
                self.engine.step()
                failures = self.engine.take_failures()
                if failures:  # the others are released below; a caller gets nothing half-done
                    raise next(iter(failures.values()))
                if bar is not None:
                    bar.update(sum(self.engine.output(r).finished for r in rids) - bar.n)
        except BaseException:
            for rid in rids:
                self.engine.release(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self.engine.release(rid) for rid in rids]

    def embed(self, prompts: Prompt | Seq[Prompt], pooling: str = "last",
              parse_special: bool = True) -> list[list[float]]:
        """One L2-normalised vector per prompt: its final normalised hidden states pooled
        ("last" position, as vLLM's decoder embedders, or "mean"), computed by the engine's
        scheduler like any prefill. A vector does not depend on the batch it ran in."""
        params = SamplingParams(max_tokens=0, pooling=pooling, temperature=0)
        return [out.embedding for out in self.generate(prompts, params, parse_special=parse_special)]

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None,
                 add_generation_prompt: bool = True, parse_special: bool = False, **template_kwargs) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                          parse_special=parse_special, **template_kwargs)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             tools: list[dict] | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, parse_special: bool = False) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the chat template is applied.
        parse_special=True: special-token text in the messages becomes tokens too."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.chat_ids(c, tools, add_generation_prompt, parse_special,
                                                      **(chat_template_kwargs or {}))}
                   for c in conversations]
        return self.generate(prompts, sampling_params)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               parse_special: bool = True) -> Iterator[StreamDelta]:
        """Yield text deltas as they are produced; closing the iterator aborts the request."""
        rid = self._submit(prompt, sampling_params or SamplingParams(), parse_special)
        try:
            yield from self.engine.stream(rid)
        finally:
            self.last_output = self.engine.release(rid)  # aborts it if the caller stopped early

    def stream_chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                    tools: list[dict] | None = None, parse_special: bool = False) -> Iterator[StreamDelta]:
        return self.stream({"prompt_token_ids": self.chat_ids(messages, tools, parse_special=parse_special)},
                           sampling_params)
