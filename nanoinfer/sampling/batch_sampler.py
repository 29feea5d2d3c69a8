"""The batched sampler: a step's rows sampled together, on the logits' device.

Each row's result equals `RowSampler.sample` on that row alone, bit for bit on the CPU. The
same operations run in the same order and precision; only the batching differs, and every
operation involved (argmax, max, softmax, log_softmax, topk, cumsum, searchsorted along the
vocabulary; elementwise arithmetic with a row's own parameters) computes each row by itself.
So a row's token cannot depend on what is sampled beside it. Batching removes the per-row
cost of dispatching a dozen operations over the vocabulary (what a GPU needs); on a CPU those
float64 passes themselves are the cost, and a device's CompiledSampling (the CPU's:
kernels/sampling.py) takes each row first, answering only where it is certain to equal this
path (docs/benchmarks.md, "Sampling").

What stays per row is cheap: the uniform number a row draws from its own generator (a seeded
request repeats whatever runs beside it), and a few logit-bias and min_tokens entries.

Rows are taken a few at a time (chunk_rows), so the float64 working copies stay in cache
whatever the batch size.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .sampler import Logprob, RowSampler

CHUNK_ROWS = 0  # rows sampled together; 0: chunk_rows()'s choice
NUCLEUS_FIRST_K = 64  # top_p looks among the top 64, then 512, ... candidates (sampler.nucleus)


@dataclass(slots=True)
class SampleRow:
    """One token to sample: whose sampler, which logits row (a fork shares its parent's), and
    the tokens sampled before it in this step that its sampler has not committed yet (a
    verification row is sampled as if the guesses before it were accepted)."""

    sampler: RowSampler
    row: int
    ahead: list[int] = field(default_factory=list)
    argmax: int | None = None  # the row's argmax, when the engine has it already


@dataclass(frozen=True)
class CompiledSampling:
    """Compiled forms of a step's two costly parts, for one device (kernels/sampling.py); each
    answers only where it is certain to equal the PyTorch path below, and leaves the rest to it.

    draw(logits, rows, uniforms): each row's token after RowSampler.process and RowSampler.draw
    (its uniform number given), or None.
    top_logprobs(lp, chosen, n): for rows of log-probabilities, each row's rank of `chosen` (1 +
    the number above it) and its n largest tokens as torch.topk orders them, or None (ties)."""

    draw: Callable[[torch.Tensor, list[SampleRow], list[float]], list[int | None]]
    top_logprobs: Callable[[torch.Tensor, torch.Tensor, int], tuple[list[int], list[list[int] | None]]]


@dataclass(slots=True)
class Sampled:
    token: int = -1
    logprobs: dict[int, Logprob] | None = None
    # The generator's state after this row's draw, kept when other rows of the same sampler drew
    # too: committing this row leaves the generator there (rows after a rejected guess never are).
    generator_state: torch.Tensor | None = None
    error: Exception | None = None


def sample_rows(logits: torch.Tensor, rows: list[SampleRow], compiled: CompiledSampling | None = None) -> list[Sampled]:
    """logits: [num_logits_rows, vocab] float32. One result per SampleRow, in order. `compiled`:
    compiled forms for the logits' device, tried first."""
    out = [Sampled() for _ in rows]
    processed: list[int] = []
    for i, r in enumerate(rows):
        if r.argmax is not None and r.sampler.takes_argmax_after(len(r.ahead)):
            out[i].token = r.argmax
        else:
            processed.append(i)
    draws = [i for i in processed if not rows[i].sampler.params.greedy]
    uniforms = draw_uniforms(rows, draws, out)
    if compiled is not None and draws:
        tokens = compiled.draw(logits, [rows[i] for i in draws], [float(uniforms[i]) for i in draws])
        for i, t in zip(draws, tokens):
            if t is not None:
                out[i].token = t
        decided = {i for i, t in zip(draws, tokens) if t is not None}
        processed = [i for i in processed if i not in decided]
    step = chunk_rows(logits.shape[-1])
    for start in range(0, len(processed), step):
        _sample_chunk(logits, rows, processed[start:start + step], uniforms, out)
    _fill_logprobs(logits, rows, out, compiled)
    return out


def chunk_rows(vocab: int) -> int:
    """Rows per chunk: on the CPU one per thread, each row's float64 copy (393 KB at 49k tokens)
    then stays in its core's L2 cache through the dozen passes over it, and the threads share
    the chunk's rows; a chunk of 40 rows ran each pass from L3 and was slower than one row at a
    time (docs/benchmarks.md, "Sampling")."""
    if CHUNK_ROWS:
        return CHUNK_ROWS
    return max(1, torch.get_num_threads())


def draw_uniforms(rows: list[SampleRow], draws: list[int], out: list[Sampled]) -> dict[int, torch.Tensor]:
    """Each sampled row's uniform number, drawn from its sampler's generator in row order (so a
    sampler's rows draw as they would one step at a time)."""
    rows_of: dict[int, int] = {}  # sampler -> how many of its rows draw
    for i in draws:
        rows_of[id(rows[i].sampler)] = rows_of.get(id(rows[i].sampler), 0) + 1
    uniforms = {}
    for i in draws:
        g = rows[i].sampler.generator
        uniforms[i] = torch.rand((), generator=g, dtype=torch.float64)
        if rows_of[id(rows[i].sampler)] > 1:  # committing any of them leaves the generator after its draw
            out[i].generator_state = g.get_state()
    return uniforms


def _sample_chunk(logits: torch.Tensor, rows: list[SampleRow], idx: list[int],
                  uniforms: dict[int, torch.Tensor], out: list[Sampled]) -> None:
    chunk = [rows[i] for i in idx]
    x = _process(logits, chunk)
    greedy = [m for m, r in enumerate(chunk) if r.sampler.params.greedy]
    if greedy:
        for m, token in zip(greedy, take(x, greedy, view=True).argmax(-1).tolist()):
            out[idx[m]].token = token
    sampled = [m for m, r in enumerate(chunk) if not r.sampler.params.greedy]
    if sampled:
        _draw(take(x, sampled, view=True), [chunk[m] for m in sampled], [idx[m] for m in sampled], uniforms, out)


def take(x: torch.Tensor, rows: list[int], view: bool = False) -> torch.Tensor:
    """x's rows: a copy the caller may change (index_select, several times faster than x[rows]
    on the CPU), or with view=True a view when the rows are consecutive (to read only)."""
    if view and rows == list(range(rows[0], rows[0] + len(rows))):
        return x[rows[0]:rows[0] + len(rows)]
    return x.index_select(0, torch.tensor(rows, device=x.device))


def _process(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """RowSampler.process for the rows' logits: the logit bias in float32; float64 once a row
    has penalties (the conversion is exact, so the other rows compare and scale as in
    float32), their penalties; the min_tokens bans. The logits are never changed: the rows
    are copied before the first change (a view when nothing changes them)."""
    # A float64 view would be changed in place below (.double() does not copy it): copy those.
    # (Whether x is a view is tracked here: an inference tensor's views do not say they are.)
    ids = [r.row for r in rows]
    own = logits.dtype == torch.float64 or ids != list(range(ids[0], ids[0] + len(ids)))
    x = take(logits, ids, view=not own)
    biased = [m for m, r in enumerate(rows) if r.sampler.bias_ids is not None]
    if biased and not own:
        x, own = x.clone(), True
    for m in biased:
        s = rows[m].sampler
        x[m].index_add_(0, s.bias_ids.to(x.device), s.bias_values.to(x.device, x.dtype))
    penalised = [m for m, r in enumerate(rows) if r.sampler.counts is not None]
    if penalised:
        x, own = x.double(), True  # a copy when x was float32
        x = on_rows(x, penalised, lambda y: _penalties(y, [rows[m] for m in penalised]))
    for m, r in enumerate(rows):
        s = r.sampler
        if s.num_generated + len(r.ahead) < s.params.min_tokens and s.banned_until_min_tokens:
            if not own:
                x, own = x.clone(), True
            x[m, s.banned_until_min_tokens] = float("-inf")
    return x


def on_rows(x: torch.Tensor, rows: list[int], fn) -> torch.Tensor:
    """fn applied to x's rows `rows` (fn may change its argument): on x itself when that is
    every row, the common case, else on a copy written back."""
    if len(rows) == len(x):
        return fn(x)
    x[rows] = fn(take(x, rows))
    return x


def per_row(x: torch.Tensor, values: list[float], dtype: torch.dtype = torch.float64) -> torch.Tensor | float:
    """A row parameter to combine with x: one Python float when all rows share it (torch then
    computes in x's dtype, as with a tensor of that value), else a column tensor."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=dtype, device=x.device)[:, None]


def _penalties(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """RowSampler.process's penalties on float64 rows (changed in place)."""
    device = x.device
    counts = torch.stack([r.sampler.counts for r in rows]).to(device)
    for m, r in enumerate(rows):
        for token in r.ahead:
            counts[m, token] += 1
    rep = [r.sampler.params.repetition_penalty for r in rows]
    if any(v != 1.0 for v in rep):  # dividing or multiplying by 1.0 is exact: such rows keep their logits
        seen = torch.stack([r.sampler.prompt_mask for r in rows]).to(device) | (counts > 0)
        rep_t = per_row(x, rep)
        x = torch.where(seen, torch.where(x > 0, x / rep_t, x * rep_t), x)
    # The frequency term in float32, as the row sampler's Python float times its float32 counts.
    freq = torch.tensor([[r.sampler.params.frequency_penalty] for r in rows], dtype=torch.float32, device=device)
    pres = per_row(x, [r.sampler.params.presence_penalty for r in rows])
    return x.sub_(freq * counts + pres * (counts > 0).double())


def _draw(x: torch.Tensor, rows: list[SampleRow], idx: list[int],
          uniforms: dict[int, torch.Tensor], out: list[Sampled]) -> None:
    """scale, then min_p, top_k, softmax, top_p and the inverse-CDF draw (RowSampler.draw)."""
    device = x.device
    top = x.amax(-1, keepdim=True).double()
    tops = top[:, 0].tolist()
    ok = []
    for m, t in enumerate(tops):
        if t == float("-inf"):
            out[idx[m]].error = ValueError("every token is excluded (min_tokens bans all that remain)")
        else:
            ok.append(m)
    if not ok:
        return
    if len(ok) < len(rows):
        x, top, rows, idx = take(x, ok), take(top, ok), [rows[m] for m in ok], [idx[m] for m in ok]
        tops = [tops[m] for m in ok]
    temperature = per_row(x, [r.sampler.params.temperature for r in rows])
    # A vanishing repetition penalty sends tokens to +inf: those share the mass.
    infinite = [m for m, t in enumerate(tops) if t == float("inf")]
    shared = torch.where(torch.isposinf(take(x, infinite)), 0.0, float("-inf")).double() if infinite else None
    z = x.double().sub_(top).div_(temperature)  # scale()'s (logits - max) / T, in float64 (x may be z now)
    if shared is not None:
        z[infinite] = shared
    vocab = z.shape[-1]
    min_p = [m for m, r in enumerate(rows) if r.sampler.params.min_p > 0.0]
    if min_p:
        def cut(zm: torch.Tensor) -> torch.Tensor:
            probs = torch.softmax(zm, -1)
            floor = per_row(zm, [rows[m].sampler.params.min_p for m in min_p])
            return zm.masked_fill_(probs < floor * probs.amax(-1, keepdim=True), float("-inf"))
        z = on_rows(z, min_p, cut)
    top_k = [m for m, r in enumerate(rows) if 0 < r.sampler.params.top_k < vocab]
    if top_k:
        ks = [rows[m].sampler.params.top_k for m in top_k]

        def keep_k(zk: torch.Tensor) -> torch.Tensor:
            kth = torch.topk(zk, max(ks)).values.gather(1, torch.tensor(ks, device=device)[:, None] - 1)
            return zk.masked_fill_(zk < kth, float("-inf"))
        z = on_rows(z, top_k, keep_k)
    probs = torch.softmax(z, -1)
    u = torch.stack([uniforms[i] for i in idx]).to(device)
    nucleus = [m for m, r in enumerate(rows) if r.sampler.params.top_p < 1.0]
    if nucleus:
        _draw_nucleus(probs, rows, idx, u, nucleus, out)
    whole = [m for m, r in enumerate(rows) if r.sampler.params.top_p >= 1.0]
    if whole:
        p = probs if len(whole) == len(rows) else take(probs, whole)
        cdf = p.cumsum(-1)
        picks = torch.searchsorted(cdf, (u[whole] * cdf[:, -1])[:, None], right=True)[:, 0].tolist()
        for j, (m, i) in enumerate(zip(whole, picks)):
            if i == vocab:  # u rounded up to the total: the last token with any mass
                i = int(torch.nonzero(p[j]).max())
            out[idx[m]].token = i


def _draw_nucleus(probs: torch.Tensor, rows: list[SampleRow], idx: list[int], u: torch.Tensor,
                  nucleus: list[int], out: list[Sampled]) -> None:
    """sampler.nucleus for many rows: each row's candidates grow (64, 512, ...) until its kept
    set ends before them, the same sizes a row alone goes through, so ties resolve the same."""
    vocab = probs.shape[-1]
    pending, k = nucleus, NUCLEUS_FIRST_K
    while pending:
        k = min(k, vocab)
        top_p = torch.tensor([[rows[m].sampler.params.top_p] for m in pending], dtype=torch.float64,
                             device=probs.device)
        vals, ids = torch.topk(probs if len(pending) == len(probs) else take(probs, pending), k)
        cdf = vals.cumsum(-1)
        kept = ((cdf - vals) < top_p).sum(-1).clamp(min=1)
        done = ((kept < k) | (k == vocab)).tolist()
        rows_done = [j for j, d in enumerate(done) if d]
        if rows_done:
            n = take(kept, rows_done)
            c = take(cdf, rows_done)
            total = c.gather(1, (n - 1)[:, None])
            # Beyond a row's kept set nothing can be picked: +inf there makes searchsorted stop at n.
            c = c.masked_fill(torch.arange(k, device=probs.device)[None, :] >= n[:, None], float("inf"))
            picks = torch.searchsorted(c, u[[pending[j] for j in rows_done]][:, None] * total, right=True)
            for j, i, count in zip(rows_done, picks[:, 0].tolist(), n.tolist()):
                if i == count:  # u rounded up to the total: the last kept token with any mass
                    i = int(torch.nonzero(vals[j, :count]).max())
                out[idx[pending[j]]].token = int(ids[j, i])
        pending = [m for m, d in zip(pending, done) if not d]
        k *= 8


def _fill_logprobs(logits: torch.Tensor, rows: list[SampleRow], out: list[Sampled],
                   compiled: CompiledSampling | None = None) -> None:
    """The model's own distribution (RowSampler.logprobs), for the rows that ask: rows grouped
    by how many top entries they want, so a row's top-n is topk(n) as alone, and taken a few
    at a time, so each row's log-softmax stays in cache for the passes over it: one row per
    thread, or four with the compiled ranks (one pass, not three; four cost least there)."""
    wanting = [i for i, r in enumerate(rows) if r.sampler.params.logprobs is not None and out[i].error is None]
    if not wanting:
        return
    by_n: dict[int, list[int]] = {}
    for i in wanting:
        by_n.setdefault(rows[i].sampler.params.logprobs or 0, []).append(i)
    step = chunk_rows(logits.shape[-1]) * (4 if compiled is not None else 1)
    for n, group in by_n.items():
        for start in range(0, len(group), step):
            _logprobs_chunk(logits, rows, group[start:start + step], n, out, compiled)


def _logprobs_chunk(logits: torch.Tensor, rows: list[SampleRow], group: list[int], n: int, out: list[Sampled],
                    compiled: CompiledSampling | None) -> None:
    lp = torch.log_softmax(take(logits, [rows[i].row for i in group], view=True), -1)
    tokens = torch.tensor([out[i].token for i in group], device=logits.device)[:, None]
    chosen = lp.gather(1, tokens)
    if compiled is not None:
        ranks, tops = compiled.top_logprobs(lp, chosen[:, 0], n)
    else:
        ranks, tops = ((lp > chosen).sum(-1) + 1).tolist(), [None] * len(group)
    if n and any(t is None for t in tops):
        top = torch.topk(lp, n).indices.tolist()
        tops = [t if t is not None else top[j] for j, t in enumerate(tops)]
    chosen = chosen[:, 0].tolist()
    values = lp.gather(1, torch.tensor(tops, device=lp.device)).tolist() if n else [[] for _ in group]
    for j, i in enumerate(group):
        entry: dict[int, Logprob] = {}
        for rank, (v, t) in enumerate(zip(values[j], tops[j] or []), 1):
            entry[t] = Logprob(v, rank)
        entry.setdefault(out[i].token, Logprob(chosen[j], ranks[j]))
        out[i].logprobs = entry
