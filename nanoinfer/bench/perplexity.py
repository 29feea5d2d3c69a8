"""`nanoinfer perplexity FILE`: perplexity on a text, by llama.cpp's protocol (`llama-perplexity
-f FILE -c CTX`), so the two figures compare directly.

The protocol, as tools/perplexity/perplexity.cpp runs it:

* the file is read as it is, less one trailing newline, and tokenised once, with BOS in
  front only if the model's tokenizer adds one (`add_special_tokens`; special-token text in
  the file stays text);
* fewer than 2 x CTX tokens is an error; the ids are cut into consecutive chunks of CTX
  tokens and the incomplete tail is dropped (`--chunks N`: the first N only);
* each chunk is one fresh forward from position 0, nothing cached across chunks; when the
  model adds BOS, a chunk's first token is replaced by BOS;
* only the second half is scored: the logits at positions first = CTX/2 .. CTX-2 against the
  tokens that follow them, CTX - CTX/2 - 1 tokens per chunk (255 for 512), so every scored
  token has at least CTX/2 tokens of context;
* ppl = exp(mean NLL over every scored token); after each chunk the running figure is
  printed as "[1]12.3456,[2]...," and at the end "Final estimate: PPL = x +/- y", the
  error as llama.cpp estimates it (the standard error of the mean NLL, times ppl).

Each chunk is one request to the engine, as llama.cpp's chunks go through its KV cache: a
prompt scored by `prompt_logprobs` with nothing generated, prefilled in the engine's chunks
into its paged KV cache and attending over the keys as the cache stores them, so
`--kv-cache-dtype` changes the figure as it changes generation (prefix caching off: nothing
carries over between chunks).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..attention import kv_cache
from ..cli_args import KV_CACHE_DTYPES, add_model_args, byte_size, positive_int
from ..errors import NanoinferError
from ..sampling import SamplingParams


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    ppl_stderr: float  # llama.cpp's "+/-"
    tokens_scored: int
    num_tokens: int  # the whole text's tokens
    ctx: int
    chunks: int
    add_bos: bool
    seconds: float  # the forwards and scoring, not the load or tokenisation
    running_ppl: list[float] = field(default_factory=list)  # after each chunk, as llama.cpp prints them


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front when asked for special tokens (llama.cpp's
    llama_vocab_get_add_bos). Probed on a short text: special-token text is never parsed here,
    so a leading BOS can only have been added."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer.encode("a", add_special_tokens=True)
    plain = tokenizer.encode("a", add_special_tokens=False)
    return with_special[:1] == [bos] and plain[:1] != [bos]


def text_ids(tokenizer, text: str) -> tuple[list[int], bool]:
    """The text's ids as llama.cpp's common_tokenize(text, add_special=true) gives them: BOS
    only if the model adds one, never EOS (llama-perplexity refuses a model that adds EOS;
    a trailing EOS would only land in the dropped tail or be scored as text)."""
    add_bos = adds_bos(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ([tokenizer.bos_token_id, *ids] if add_bos else ids), add_bos


def check_ctx(ctx: int) -> None:
    if ctx < 3:
        raise NanoinferError(f"--ctx must be at least 3 (its first half is context, the rest is scored), got {ctx}")


def count_chunks(num_tokens: int, ctx: int, max_chunks: int | None = None) -> int:
    """How many chunks of `ctx` tokens are evaluated; too short a text is an error."""
    check_ctx(ctx)
    if num_tokens < 2 * ctx:  # llama.cpp's rule, so both accept and refuse the same files
        raise NanoinferError(f"the text tokenizes to only {num_tokens} tokens; perplexity with --ctx {ctx} "
                             f"needs at least {2 * ctx} (2 x ctx, as in llama.cpp)")
    n_chunks = num_tokens // ctx
    return n_chunks if max_chunks is None else min(n_chunks, max_chunks)


# One chunk's ids -> the negative log-likelihoods of its tokens first+1 .. ctx-1 (first = ctx // 2).
ChunkScorer = Callable[[list[int]], torch.Tensor]


def engine_scorer(llm) -> ChunkScorer:
    """Chunks scored by an LLM's engine: the chunk as a prompt with prompt_logprobs and no
    generated token, its keys and values through the engine's paged KV cache."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0)

    def score(chunk: list[int]) -> torch.Tensor:
        (out,) = llm.generate([{"prompt_token_ids": chunk}], params, use_tqdm=False)
        first = len(chunk) // 2
        lps = out.prompt_logprobs
        return torch.tensor([-lps[i][chunk[i]].logprob for i in range(first + 1, len(chunk))], dtype=torch.float64)

    return score


def perplexity(score: ChunkScorer, ids: list[int], ctx: int, *, bos: int | None = None,
               max_chunks: int | None = None,
               on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """llama.cpp's perplexity over `ids` (already tokenised, BOS included where the model
    adds one), each chunk scored by `score` (engine_scorer). bos: the id that replaces each
    chunk's first token (None: the model adds no BOS, chunks are the text as it is).
    on_chunk(i, running_ppl) after each chunk, from 1."""
    n_chunks = count_chunks(len(ids), ctx, max_chunks)
    t0 = time.perf_counter()
    nll_sum = nll2_sum = 0.0
    count = 0
    running = []
    for i in range(n_chunks):
        chunk = ids[i * ctx:(i + 1) * ctx]
        if bos is not None:
            chunk[0] = bos  # a fresh copy: the text's ids stay as they are
        nll = score(chunk)
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += len(nll)
        running.append(math.exp(nll_sum / count))
        if on_chunk is not None:
            on_chunk(i + 1, running[-1])
    mean = nll_sum / count
    ppl = math.exp(mean)
    var = nll2_sum / count - mean * mean
    stderr = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    return PerplexityResult(ppl=ppl, nll=mean, ppl_stderr=stderr, tokens_scored=count, num_tokens=len(ids), ctx=ctx,
                            chunks=n_chunks, add_bos=bos is not None, seconds=time.perf_counter() - t0,
                            running_ppl=running)


def read_text(path: str) -> str:
    """The file as llama.cpp's `-f` reads it: bytes as they are (no newline translation),
    less one trailing newline."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise NanoinferError(f"{path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NanoinferError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return text[:-1] if text.endswith("\n") else text


def run(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..llm import DTYPES, LLM

    check_ctx(a.ctx)
    text = read_text(a.file)  # a bad flag or a missing file fails before the model loads
    if a.dtype not in DTYPES:
        raise NanoinferError(f"--dtype {a.dtype!r} must be one of {', '.join(DTYPES)}")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        raise NanoinferError(f"--device {a.device!r}: not a device (cpu, cuda, cuda:N)") from None
    # a chunk is a prompt of ctx tokens that generates nothing: a window of ctx holds it
    llm = LLM(a.model, dtype=a.dtype, device=str(device), max_model_len=a.ctx, kv_cache_dtype=a.kv_cache_dtype,
              enable_prefix_caching=False, attention_backend=a.attention_backend, kv_cache_memory=a.kv_cache_memory)
    lm = llm.loaded
    if llm.max_model_len < a.ctx:
        window = lm.config.max_position_embeddings
        raise NanoinferError(f"--ctx {a.ctx} is longer than the model's context window ({window})" if a.ctx > window
                             else f"--ctx {a.ctx} does not fit the KV pool ({llm.max_model_len} tokens): "
                                  f"set --kv-cache-memory")
    print(f"[{lm.path.name}: {lm.format}, {lm.config.architecture}, {a.dtype}, KV cache "
          f"{kv_cache.format_name(llm.engine.kv_dtype)}, loaded in {lm.load_seconds:.1f}s]", file=sys.stderr)

    ids, add_bos = text_ids(lm.tokenizer, text)
    n_chunks = count_chunks(len(ids), a.ctx, a.chunks)  # a short text fails here, before the bar
    print(f"[{len(ids)} tokens, BOS {'added' if add_bos else 'not added'}; {n_chunks} chunks of {a.ctx}, "
          f"scoring the last {a.ctx - a.ctx // 2 - 1} tokens of each]", file=sys.stderr)

    # The running figures go to stdout as llama.cpp prints them. On a terminal, where the bar
    # would overwrite them, the bar shows the running figure and the line comes at the end.
    live = not sys.stdout.isatty()
    bar = tqdm(total=n_chunks, desc="perplexity", unit="chunk", file=sys.stderr,
               disable=a.no_progress)

    def on_chunk(i: int, ppl: float) -> None:
        if live:
            print(f"[{i}]{ppl:.4f},", end="", flush=True)
        bar.set_postfix_str(f"ppl {ppl:.4f}", refresh=False)
        bar.update(1)

    try:
        r = perplexity(engine_scorer(llm), ids, a.ctx, bos=lm.tokenizer.bos_token_id if add_bos else None,
                       max_chunks=a.chunks, on_chunk=on_chunk)
    except KeyboardInterrupt:
        bar.close()
        print(f"\n[stopped after {bar.n} of {n_chunks} chunks]", file=sys.stderr)
        return 130
    bar.close()
    if not live:
        print("".join(f"[{i}]{p:.4f}," for i, p in enumerate(r.running_ppl, 1)), end="")
    print()
    print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.ppl_stderr:.5f} "
          f"({r.tokens_scored} tokens scored, {r.seconds:.1f}s)")
    if a.json:
        doc = {"ppl": r.ppl, "ppl_stderr": r.ppl_stderr, "nll": r.nll, "tokens_scored": r.tokens_scored,
               "num_tokens": r.num_tokens, "ctx": r.ctx, "chunks": r.chunks, "add_bos": r.add_bos,
               "model": str(lm.path), "dtype": a.dtype, "kv_cache_dtype": kv_cache.format_name(llm.engine.kv_dtype),
               "device": str(device), "file": a.file,
               "seconds": round(r.seconds, 3), "running_ppl": [round(p, 6) for p in r.running_ppl]}
        print(json.dumps(doc), flush=True)
    return 0


def add_perplexity_parser(subparsers) -> argparse.ArgumentParser:
    """Add `perplexity FILE` to a CLI's subparsers."""
    p = subparsers.add_parser(
        "perplexity", help="perplexity on a text file, by llama.cpp's protocol",
        description="Perplexity on FILE as llama.cpp's llama-perplexity computes it: consecutive chunks of CTX "
                    "tokens, each evaluated alone through the engine's KV cache, scored on their second half. "
                    "Running figures and the final "
                    "estimate on stdout, progress on stderr.")
    p.add_argument("file", metavar="FILE", help="UTF-8 text (at least 2 x CTX tokens)")
    add_model_args(p, max_model_len=False)  # (the window: ctx + 1)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype, as for generation: auto (bf16 for a GGUF run in its blocks, else the "
                        "model's) | float32 | bfloat16 | q8_0 (8-bit blocks, 0.53x bf16's bytes)")
    p.add_argument("--kv-cache-memory", type=byte_size, default=None,
                   help="KV pool size (default: what the machine allows)")
    p.add_argument("--ctx", "-c", type=positive_int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=positive_int, default=None, help="evaluate the first N chunks only (default all)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p
