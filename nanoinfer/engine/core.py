"""The engine core: requests in, one step at a time, deltas out.

    step():  schedule -> build batch -> forward -> sample -> process outputs
             (who runs,   (tokens,       (model,     (per-row     (append, detokenize,
              how many     positions,     paged       params,      stop checks, fork
              tokens)      block tables)  attention)  seeds)       samples, free blocks)

Every step is one forward over all scheduled sequences: decodes (1 token each) and
prefill chunks share one token budget. A sequence that finishes leaves the batch in
the same step and its blocks go back to the pool.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ..attention import PagedKVCache, backend_class, kv_cache
from ..distributed.executor import TensorParallelExecutor, WorkerSetup
from ..distributed.sharding import rank_config
from ..errors import InvalidRequestError, NanoinferError, RequestFailedError
from ..kernels.quant_linear import has_block_weights
from ..kernels.sampling import compiled_for
from ..models.builder import LoadedModel
from ..sampling import Logprob, RowSampler, Sampled, SampleRow, SamplingParams, sample_rows
from ..spec_decode import NgramProposer, Proposer, SpeculativeConfig, StepTimes, updated_accept_rate, worth_checking
from ..structured import ConstraintLimits, StructuredOutputs
from ..tokenizer import IncrementalDetokenizer, StopMatcher
from ..tools.tool_use import ToolUseState, bind_tools
from .draft import DraftModelProposer
from .kv_manager import GroupSpec
from .memory import GroupCost, MemoryBudget, plan_kv_pool
from .outputs import ForwardStat, RequestOutput, StreamDelta, spec_figures
from .prefix_store import DiskPrefixCache, file_identity, store_key
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence


@dataclass
class EngineConfig:
    max_model_len: int | None = None  # default: the model's context window (clamped to the KV pool)
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: memory.py's rule
    kv_memory_share: float = 1.0  # the share of the machine's memory the default pool is sized from (1/N for N replicas)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    # engine/prefix_store.py: full KV blocks also kept in this folder (shared by restarts and
    # replicas), at most prefix_cache_dir_bytes of them; None: memory only
    prefix_cache_dir: str | None = None
    prefix_cache_dir_bytes: int = 4 << 30
    enable_tools: bool = True  # run tools (the calculator) when the vocabulary has their marker tokens
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: "auto" is kv_cache_dtype()'s rule
    attention_backend: str = "auto"  # a registered name (attention/), or the first that runs on the device and KV dtype
    scheduling_policy: str = "fcfs"  # engine/policy.py: "fcfs" or "priority" (requests' `priority`, lower first)
    # engine/pacing.py: a step that decodes takes about this long, prefill chunks sized to fit; None: no bound
    step_time_target_ms: float | None = None
    speculative_config: SpeculativeConfig | dict | None = None  # vLLM's: {"method": "ngram", ...}
    constraint_limits: ConstraintLimits | dict | None = None  # structured outputs' limits (None: the defaults)
    # >1: the model split over this many processes (distributed/): the model must have been
    # loaded as rank 0's share (LLM does this); the engine starts the other ranks.
    tensor_parallel_size: int = 1


logger = logging.getLogger("nanoinfer.engine")


KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "q8_0": kv_cache.Q8_0}


def kv_cache_dtype(model: torch.nn.Module, requested: str = "auto") -> torch.dtype:
    """The KV cache's dtype. "auto": bf16 for a model whose weights stay in their GGUF blocks on
    the CPU (its activations are fp32, but k and v are rounded once, as stored, at half the
    bytes of fp32; llama.cpp keeps f16), else the model's own dtype."""
    if requested not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype={requested!r} must be one of {', '.join(KV_CACHE_DTYPES)}",
                                  "kv_cache_dtype")
    if KV_CACHE_DTYPES[requested] is not None:
        return KV_CACHE_DTYPES[requested]
    param = next(model.parameters())
    if param.device.type == "cpu" and has_block_weights(model):
        return torch.bfloat16
    return param.dtype


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_config = mc = loaded.config
        param = next(self.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.kv_dtype = kv_cache_dtype(self.model, config.kv_cache_dtype)
        # a backend that cannot run here is refused now, before a pool or a worker exists
        self.attention_backend = backend_class(config.attention_backend, self.device, self.kv_dtype)
        tp = config.tensor_parallel_size
        rank_mc = rank_config(mc, tp) if tp > 1 else mc  # what this process's attention and KV pool hold
        # One sequence must always fit in the pool, or preemption could never make room.
        if kv_cache.is_q8(self.kv_dtype) and mc.head_dim % kv_cache.Q8_BLOCK:
            raise InvalidRequestError(f"kv_cache_dtype=q8_0 needs a head size that is a multiple of 32; this model's is "
                                      f"{mc.head_dim}", "kv_cache_dtype")
        # layers grouped by window, each group its own pool (kv_cache.kv_groups); not under tensor
        # parallelism, whose ranks size one pool alike
        self.kv_groups = kv_cache.kv_groups(mc.windows(), min(config.max_model_len or mc.max_position_embeddings,
                                                              mc.max_position_embeddings), by_window=tp == 1)
        layer_bytes = rank_mc.kv_bytes_per_token(kv_cache.value_bytes(self.kv_dtype)) / mc.num_layers
        costs = [GroupCost(math.ceil(layer_bytes * len(g.layers)), g.window) for g in self.kv_groups]
        plan = plan_kv_pool(costs, config.block_size, mc.max_position_embeddings, config.max_model_len,
                            config.kv_cache_memory, config.max_num_seqs, MemoryBudget.now(), config.kv_memory_share,
                            chunk=config.max_num_batched_tokens)
        if plan.note:
            logger.warning(plan.note)
        num_blocks, self.max_model_len = plan.num_blocks, plan.max_model_len
        try:
            self.cache = PagedKVCache.allocate(self.kv_groups, num_blocks, config.block_size, rank_mc.num_kv_heads,
                                               mc.head_dim, self.kv_dtype, self.device)
        except (OSError, MemoryError, RuntimeError) as e:  # the machine changed since it was measured
            raise InvalidRequestError(f"cannot allocate a KV pool of {sum(num_blocks)} blocks: {e}; "
                                      f"set --kv-cache-memory", "kv_cache_memory") from None
        if hasattr(self.model, "set_context"):  # LongRoPE's short or long factors follow the window
            self.model.set_context(self.max_model_len)
        if config.step_time_target_ms is not None and not config.step_time_target_ms > 0:
            raise InvalidRequestError(f"step_time_target_ms must be > 0, got {config.step_time_target_ms}",
                                      "step_time_target_ms")
        step_target = config.step_time_target_ms / 1e3 if config.step_time_target_ms else None
        # the persistent prefix cache: one folder per KV group (its layers' blocks)
        self.disk_caches = self._disk_caches(loaded, config, mc, costs) if config.prefix_cache_dir else []
        groups = [GroupSpec(g.window, n) for g, n in zip(self.kv_groups, num_blocks)]
        self.scheduler = Scheduler(SchedulerConfig(groups, config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.block_size, config.enable_prefix_caching,
                                                   config.scheduling_policy, step_target), tiers=self.disk_caches or None)
        self.executor = None
        if tp > 1:
            self.executor = TensorParallelExecutor(tp, str(self.device))
            src = loaded.source
            self.executor.setup(WorkerSetup(src["path"], src["dtype"], src["overrides"], self.kv_groups, num_blocks,
                                            config.block_size, self.kv_dtype, self.max_model_len,
                                            self.attention_backend))
        self.runner = ModelRunner(self.model, rank_mc, self.cache, self.attention_backend, self.executor)
        self.tools = bind_tools(self.tokenizer) if config.enable_tools else []
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size, ConstraintLimits.of(config.constraint_limits))
        self.spec = SpeculativeConfig.of(config.speculative_config)
        self.proposer: Proposer | None = None
        if self.spec is not None and self.spec.method == "ngram":
            tok = self.tokenizer  # each token's text: the lookup matches words, not whitespace (spec_decode/ngram.py)
            self.proposer = NgramProposer(self.spec, [tok.decode([i], skip_special_tokens=False)
                                                      for i in range(tok.vocab_size)])
        elif self.spec is not None:
            self.proposer = DraftModelProposer(self.spec, loaded, max(num_blocks), config.block_size, self.max_model_len,
                                               self.kv_dtype, self.attention_backend)
        self.step_times = StepTimes()  # decode steps' times by rows: what checking guesses costs here
        self.spec_proposed = self.spec_accepted = 0  # proposed and accepted tokens, for metrics
        self.spec_checks = 0  # sequence-steps that checked guesses
        self.requests: dict[str, list[Sequence]] = {}
        self.failures: dict[str, NanoinferError] = {}  # requests ended alone by an error, until taken
        self.last_step_tokens = 0
        self.total_steps = 0
        self.total_step_tokens = 0
        self.prefill_tokens = 0  # prompt tokens run through the model (a prefix-cache hit or an n-fork runs none)

    # --- requests ---------------------------------------------------------------
    def validate_prompt(self, prompt_ids: list[int], scoring: bool = False) -> None:
        """scoring: the request generates nothing (max_tokens 0), so the prompt may fill the window."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        n = len(prompt_ids)
        if n > self.max_model_len or (n == self.max_model_len and not scoring):
            room = "" if scoring else ": no room to generate"
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the context window is {self.max_model_len}{room} "
                f"(shorten the prompt)", code="context_length_exceeded")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Everything add_request refuses, checked without adding (so a batch can be checked whole first)."""
        self.validate_prompt(prompt_ids, scoring=params.max_tokens == 0)
        vocab = self.model_config.vocab_size
        params.check_vocabulary(vocab)
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} is over this engine's max_num_seqs={self.config.max_num_seqs}",
                                      param="n")
        if params.min_tokens and len(set(self.tokenizer.eos_token_ids) | set(params.stop_token_ids)) >= vocab:
            raise InvalidRequestError("stop_token_ids with min_tokens leave no token to generate",
                                      param="stop_token_ids")
        if params.pooling is not None and self.executor is not None:
            raise InvalidRequestError("pooling (embeddings) is not served under tensor parallelism", param="pooling")
        if params.structured_outputs is not None:  # compiled once and cached: add_request finds it
            self.structured.compile(params.structured_outputs)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0) -> None:
        """priority: vLLM's (lower first; only the "priority" scheduling policy reads it)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_ids, params)
        banned = sorted(set(self.tokenizer.eos_token_ids) | set(params.stop_token_ids))
        seqs = []
        for i in range(params.n):
            # Samples of one seeded request differ from each other and repeat as a set.
            row_params = params if params.seed is None or i == 0 else replace(params, seed=(params.seed + i) % (1 << 64))
            seqs.append(Sequence(
                request_id, i, prompt, list(prompt_ids), params,
                RowSampler(row_params, self.model_config.vocab_size, prompt_ids, banned),
                IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
                StopMatcher(params.stop), self.tokenizer.eos_token_ids, self.max_model_len,
                ToolUseState(self.tools, self.tokenizer) if self.tools else None,
                self.structured.matcher(params.structured_outputs) if params.structured_outputs else None,
            ))
        # n samples share one prefill: only the first is scheduled; the others fork from it.
        seqs[0].forks = seqs[1:]
        for seq in seqs:
            seq.sched.priority = priority
        self.requests[request_id] = seqs
        self.scheduler.add(seqs[0])

    def abort(self, request_id: str) -> list[StreamDelta]:
        deltas = []
        for seq in self.requests.get(request_id, []):
            if not seq.finished:
                deltas.append(seq.abort())
                self.scheduler.finish(seq)
        return deltas

    def pause(self, request_id: str, paused: bool = True) -> None:
        """Stop (or resume) scheduling a request's samples; they keep their KV blocks. For a
        reader that has fallen behind: its output waits instead of piling up."""
        for seq in self.requests.get(request_id, []):
            seq.sched.paused = paused

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_schedulable(self) -> bool:
        return self.scheduler.has_schedulable()

    @property
    def blocks(self):
        """The scheduler's block manager, for reading (metrics, tests); only the scheduler changes it."""
        return self.scheduler.blocks

    def output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        return RequestOutput(request_id, seqs[0].prompt, seqs[0].prompt_ids, [s.completion() for s in seqs],
                             all(s.finished for s in seqs), [s.stats for s in seqs], seqs[0].prompt_logprobs,
                             seqs[0].embedding)

    def release(self, request_id: str) -> RequestOutput:
        """The final output of a request; the engine forgets it (aborting it if still running)."""
        self.abort(request_id)
        out = self.output(request_id)
        del self.requests[request_id]
        return out

    # --- the loop ---------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.cache.copy_blocks(batch.block_copies)
        t0 = time.perf_counter()
        logits, step_rows, hidden = self.runner.run(batch)
        # Rows sample on the CPU with their own CPU generators: a seed gives the same tokens on
        # any device. The copy also waits for the device, so `seconds` is the real step time.
        logits = logits.cpu()
        samplers = step_rows.samplers
        r = 0
        for i, first, count in step_rows.hidden:  # pooling sequences take their positions' hidden states
            batch.seqs[i].take_hidden(first, hidden[r:r + count])
            r += count
        if step_rows.prompt:  # rows after the sampling ones score prompt tokens
            self._score_prompts(batch, step_rows.prompt, logits[len(samplers):])
            logits = logits[:len(samplers)]
        seconds = time.perf_counter() - t0
        tokens = batch.total_tokens
        if self.proposer is not None and all(n == 1 + len(seq.spec.tokens) for seq, n in zip(batch.seqs, batch.num_tokens)):
            self.step_times.observe(tokens, seconds)  # decode rows only
        self.scheduler.pacer.observe(tokens, seconds)
        self.last_step_tokens = tokens
        self.total_steps += 1
        self.total_step_tokens += tokens
        self.prefill_tokens += sum(min(n, max(0, len(seq.prompt_ids) - seq.kv.num_computed))
                                   for seq, n in zip(batch.seqs, batch.num_tokens))
        self.scheduler.update_after_forward(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.stats.forwards.append(ForwardStat(seq.kv.num_computed, n, seconds))
        # Constrained rows: what their grammars disallow is -inf before anything samples (forks
        # sample their first token from their parent's row, in the same grammar state).
        # A row checking a proposed token takes the grammar's state after the guesses before it.
        constrained, j = [], 0
        for row, i in enumerate(samplers if any(s.grammar is not None for s in batch.seqs) else ()):
            j = j + 1 if row and samplers[row - 1] == i else 0  # which of the sequence's rows (0: its own)
            seq = batch.seqs[i]
            if seq.grammar is not None:
                constrained.append((row, seq.spec.states[j - 1] if j else seq.grammar, seq.tokens_left - j))
        if constrained:
            for row, error in self.structured.apply_masks(logits, constrained).items():
                rid = batch.seqs[samplers[row]].request_id
                if rid not in self.failures:
                    self._fail(rid, error)
        # One reduction for every plain greedy row, in numpy: torch's CPU argmax over a 49k
        # vocabulary takes ~65 us a row, numpy's ~7 (both: the first maximum, a NaN first).
        argmax = (logits.numpy().argmax(-1).tolist()
                  if any(batch.seqs[i].sampler.takes_argmax_after() for i in samplers) else [None] * len(samplers))
        # Every row samples at once (forks from their parent's row, a verification row as if the
        # guesses before it were taken); then each sequence takes its tokens in order.
        plan: list[tuple[Sequence, range]] = []
        jobs: list[SampleRow] = []
        row = 0
        while row < len(samplers):
            seq = batch.seqs[samplers[row]]
            rows = range(row, row + 1 + len(seq.spec.tokens))  # its row, then one per proposed token
            row = rows.stop
            if seq.finished:  # its request failed earlier in this step
                continue
            plan.append((seq, rows))
            if seq.params.max_tokens == 0:
                continue
            jobs.extend(SampleRow(fork.sampler, rows[0], [], argmax[rows[0]]) for fork in seq.forks)
            jobs.extend(SampleRow(seq.sampler, r, seq.spec.tokens[:j], argmax[r]) for j, r in enumerate(rows))
        sampled = iter(self._sample_rows(logits, jobs))
        deltas = []
        for seq, rows in plan:
            if seq.params.max_tokens == 0:  # scoring: the prompt's logprobs are all it asked for
                for s in (seq, *seq.forks):
                    deltas.append(s.finish_scored())
                    self.scheduler.finish(s)
                seq.forks = []
                continue
            mine = [next(sampled) for _ in range(len(seq.forks) + len(rows))]
            # An error here belongs to this request alone (its parameters, its text): it ends
            # with the error and the batch goes on.
            try:
                for fork, result in zip(seq.forks, mine):
                    self.scheduler.fork(seq, fork)
                    fork.prompt_logprobs = seq.prompt_logprobs  # each sample's first delta carries the prompt's
                    deltas.append(self._commit(fork, result))
                mine = mine[len(seq.forks):]
                seq.forks = []
                if seq.spec.tokens:
                    deltas.extend(self._verify(seq, mine))
                else:
                    deltas.append(self._commit(seq, mine[0]))
            except Exception as e:
                self._fail(seq.request_id, e)
        if self.proposer is not None:
            if not self.scheduler.running:
                self.proposer.retain(set())  # nothing runs: a draft model gives its blocks back
            else:  # prompts that finished prefilling: a draft model reads them now (time to first token)
                first = [((s.request_id, s.index), s.all_ids) for s in batch.seqs
                         if not s.finished and len(s.output_ids) == 1 and s.kv.num_computed == s.length - 1]
                if first:
                    self.proposer.prefill(first)
        return [d for d in deltas if d.request_id not in self.failures] if self.failures else deltas

    def _propose(self) -> None:
        """Proposed next tokens for each decoding sequence, unless the batch is large enough
        that the step is compute-bound (SpeculativeConfig.disable_by_batch_size). Each
        sequence asks for as many as pay for their check at its running acceptance rate and
        the step times measured so far (spec_decode.policy); one that asks for none tries one
        guess every retry_after steps, one that asks for some all of them. Not with forks
        pending, nor for a JSON row whose budget rule may act within the guesses. A row under
        a grammar keeps the guesses its grammar allows, and each verified position is masked
        with the grammar's state after the guesses before it."""
        running = self.scheduler.running
        self.proposer.retain({(s.request_id, s.index) for s in running})
        decoding = [s for s in running if s.kv.num_computed == s.length - 1]
        if len(decoding) >= self.spec.disable_by_batch_size:
            return
        k_max = self.spec.num_speculative_tokens
        costs = None  # verify_cost 0: checks taken as free, every sequence always asks for all its guesses
        if self.spec.verify_cost:
            if len(decoding) not in self.step_times.seconds:
                return  # a step without guesses first: what they add is measured against it
            costs = self.step_times.step_costs(len(decoding), k_max, self.spec.verify_cost, self.proposer.guess_cost)
        asking: list[tuple[Sequence, int]] = []
        for seq in decoding:
            if seq.forks or seq.finished:
                continue
            k = k_max if costs is None else worth_checking(seq.spec.accept_rate, costs)
            if 0 < k < k_max and self.total_steps % self.spec.retry_after == 0:
                k = k_max  # now and then the longest check, so that its time stays measured, not one noisy figure
            if k == 0:
                seq.spec.idle_steps += 1
                if seq.spec.idle_steps < self.spec.retry_after:
                    continue  # its guesses have been missing: checking them costs more than they save
                k = 1
            if seq.grammar is not None and not seq.grammar.budget_rule_idle(seq.tokens_left - k - 1):
                continue  # near its budget a JSON row may be closing: its masks are the budget rule's
            asking.append((seq, min(k, seq.tokens_left - 1)))
        guesses = self.proposer.propose_many([((s.request_id, s.index), s.all_ids, k) for s, k in asking])
        for (seq, _), spec in zip(asking, guesses):
            if seq.grammar is not None:  # guesses the grammar forbids could never be accepted
                seq.spec.states = seq.grammar.states_after(spec)
                spec = spec[:len(seq.spec.states)]
            seq.spec.tokens = spec
            self.spec_proposed += len(spec)
            if spec:
                seq.spec.idle_steps = 0

    def _verify(self, seq: Sequence, results: list[Sampled]) -> list[StreamDelta]:
        """Take the rows' tokens position by position, as the sequence would without speculation
        (the rows' logits are the single-token decode's, bit for bit, and each row was sampled
        as if the guesses before it were taken): a proposed token is accepted exactly when it
        equals the token sampled at its position. The first mismatch (or the bonus row after
        all k) gives the last token."""
        spec, start = seq.spec.tokens, seq.kv.num_computed
        deltas, matched, rejected = [], 0, False
        for j, result in enumerate(results):
            delta = self._commit(seq, result)
            deltas.append(delta)
            if seq.finished or len(delta.token_ids) > 1:  # ended, or a tool forced tokens in
                break
            if j == len(spec):
                break
            if delta.token_ids[0] != spec[j]:
                rejected = True
                break
            matched += 1
        seq.spec.accept_rate = updated_accept_rate(seq.spec.accept_rate, matched, matched + rejected)
        seq.spec.tokens, seq.spec.states = [], []
        self.spec_accepted += matched
        self.spec_checks += 1
        st = seq.stats
        st.spec_proposed, st.spec_accepted, st.spec_checks = st.spec_proposed + len(spec), st.spec_accepted + matched, \
            st.spec_checks + 1
        if not seq.finished:  # the accepted tokens' KV is in the cache; the last token's is not yet
            self.scheduler.advance(seq, min(start + matched, seq.length - 1) - seq.kv.num_computed)
        return deltas

    @staticmethod
    def _score_prompts(batch, prompt_rows: list[tuple[int, int, int]], logits: torch.Tensor) -> None:
        """Prompt tokens' logprobs from the rows that predict them, as RowSampler.logprobs reports
        sampled tokens' (the model's own distribution): the token's, and the top prompt_logprobs."""
        lp = torch.log_softmax(logits.float(), -1)
        r = 0
        for i, first, count in prompt_rows:
            seq, k = batch.seqs[i], batch.seqs[i].params.prompt_logprobs
            block, r = lp[r:r + count], r + count
            targets = torch.tensor(seq.prompt_ids[first + 1:first + 1 + count])
            chosen = block.gather(1, targets[:, None])[:, 0]
            ranks = ((block > chosen[:, None]).sum(1) + 1).tolist()
            top = torch.topk(block, k) if k else None
            for j, (token, value) in enumerate(zip(targets.tolist(), chosen.tolist())):
                if first + 1 + j != len(seq.prompt_logprobs):  # scored already (computed again after a preemption)
                    continue
                entry: dict[int, Logprob] = {}
                if top is not None:
                    for rank, (v, t) in enumerate(zip(top.values[j].tolist(), top.indices[j].tolist()), 1):
                        entry[t] = Logprob(v, rank)
                entry.setdefault(token, Logprob(value, ranks[j]))
                seq.prompt_logprobs.append(entry)

    def _fail(self, request_id: str, error: Exception) -> None:
        """End a request alone. Its own doing (an InvalidRequestError: its constraint failed) is
        passed on as it is, logged in one line; anything else is an internal error (logged with
        its traceback) and becomes a RequestFailedError."""
        for seq in self.requests[request_id]:
            if not seq.finished:
                seq.abort()
            self.scheduler.finish(seq)
        if isinstance(error, InvalidRequestError):
            logger.warning("request %s ended: %s", request_id, error)
            self.failures[request_id] = error
            return
        logger.error("request %s failed", request_id, exc_info=error)
        self.failures[request_id] = RequestFailedError(
            f"internal error in request {request_id}: {type(error).__name__}: {' '.join(str(error).split())}"[:500])

    def take_failures(self) -> dict[str, NanoinferError]:
        """Requests that an internal error ended since the last call (their caller gets the error)."""
        failures, self.failures = self.failures, {}
        return failures

    @staticmethod
    def _sample_rows(logits: torch.Tensor, jobs: list[SampleRow]) -> list[Sampled]:
        """The batched sampler; should it fail (a bug, not a request's doing), each row again
        alone, so that the error stays with the row that raised it. The generators are not
        rewound for that: the step's draws continue from where the failed attempt left them
        (snapshotting every generator each step, for a path that should never run, cost more)."""
        try:
            return sample_rows(logits, jobs, compiled_for(logits.device))
        except Exception:
            rows_of = Counter(id(j.sampler) for j in jobs)
            results = []
            for job in jobs:
                try:
                    result = sample_rows(logits, [job])[0]
                except Exception as e:
                    result = Sampled(error=e)
                if rows_of[id(job.sampler)] > 1 and not job.sampler.params.greedy:
                    result.generator_state = job.sampler.generator.get_state()
                results.append(result)
            return results

    def _commit(self, seq: Sequence, result: Sampled) -> StreamDelta:
        """The sampled token becomes the sequence's next (its sampler counts it)."""
        if result.error is not None:
            raise result.error
        seq.sampler.commit(result.token, result.generator_state)
        delta = seq.append(result.token, result.logprobs)
        if seq.finished:
            seq.stats.finished = time.perf_counter()
            self.scheduler.finish(seq)
        return delta

    def stream(self, request_id: str) -> Iterator[StreamDelta]:
        """Step until this request finishes, yielding its deltas (others advance too)."""
        while not all(s.finished for s in self.requests[request_id]):
            deltas = self.step()
            if request_id in self.failures:
                raise self.failures.pop(request_id)
            for d in deltas:
                if d.request_id == request_id:
                    yield d

    def _disk_caches(self, loaded: LoadedModel, config: EngineConfig, mc, costs: list[GroupCost]
                     ) -> list[DiskPrefixCache]:
        """The persistent prefix cache's folders for this model and configuration (prefix_store.py),
        one per KV group, sharing the size cap in proportion to a token's bytes in each."""
        if not config.enable_prefix_caching:
            raise InvalidRequestError("prefix_cache_dir needs prefix caching on", "prefix_cache_dir")
        if config.tensor_parallel_size > 1:
            logger.warning("prefix_cache_dir: not with tensor parallelism (each rank holds part of a block); "
                           "the prefix cache stays in memory")
            return []
        identity = file_identity(loaded.path)
        total = sum(c.bytes_per_token for c in costs)
        caches = []
        for group, cost, k, v in zip(self.kv_groups, costs, self.cache.k, self.cache.v):
            key = store_key(model=identity, dtype=str(loaded.source.get("dtype")), kv=str(self.kv_dtype),
                            max_model_len=self.max_model_len, block_size=config.block_size, tp=(0, 1),
                            architecture=mc.architecture, layers=group.layers, window=group.window)
            caches.append(DiskPrefixCache(config.prefix_cache_dir, config.prefix_cache_dir_bytes * cost.bytes_per_token
                                          // total, key, (k[:, 0].numel() * k.element_size()) * 2, *_block_io(k, v)))
        return caches

    # --- metrics ----------------------------------------------------------------
    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and finish writing the persistent prefix
        cache (the engine cannot step afterwards)."""
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        for disk in self.disk_caches:
            disk.close()

    def metrics(self) -> dict:
        s, b = self.scheduler, self.blocks
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "preemptions": s.num_preemptions,
            "kv_blocks_total": b.num_blocks,  # every KV group's
            "kv_blocks_used": b.num_used,
            "kv_blocks_free": b.num_free,
            "kv_usage": b.num_used / b.num_blocks,
            "prefix_cache_queries": b.stats.prefix_queries,
            "prefix_cache_hits": b.stats.prefix_hits,
            "prefix_cache_hit_rate": b.stats.hit_rate,
            "prefix_cache_disk_hits": b.stats.tier_hits,  # of the hits, tokens read back from --prefix-cache-dir
            "steps": self.total_steps,
            "prefill_tokens": self.prefill_tokens,
            "tokens_per_step": self.total_step_tokens / self.total_steps if self.total_steps else 0.0,
            "last_step_tokens": self.last_step_tokens,
            **spec_figures(self.spec_proposed, self.spec_accepted, self.spec_checks),
        }


def _block_io(k: torch.Tensor, v: torch.Tensor):
    """A group's pool read and written one block at a time, as bytes (the disk tier's side)."""

    def read_block(bid: int) -> bytes:
        return torch.cat([k[:, bid].reshape(-1).view(torch.uint8), v[:, bid].reshape(-1).view(torch.uint8)]
                         ).cpu().numpy().tobytes()

    def write_block(bid: int, payload: bytes) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        half = len(payload) // 2
        k[:, bid].copy_(data[:half].view(k.dtype).view(k[:, bid].shape))
        v[:, bid].copy_(data[half:].view(v.dtype).view(v[:, bid].shape))

    return read_block, write_block
