"""Speculative decoding (n-gram prompt lookup and a draft model): the same tokens and the
same logprob bits as without it, greedy and seeded-sampled, alone and among 31 other
requests, with chunked prefill, preemption, stop strings and max_tokens cutting a run of
accepted guesses short."""
from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.errors import InvalidRequestError
from nanoinfer.spec_decode import NgramProposer, SpeculativeConfig, StepTimes
from nanoinfer.spec_decode.ngram import word_classes

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def prompts(n: int) -> list[dict]:
    """Prompts that repeat themselves (so lookups hit), each different."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        motif = torch.randint(3, 300, (3 + i % 5,), generator=g).tolist()
        out.append({"prompt_token_ids": (motif * (2 + i % 4))[: 6 + 3 * (i % 9)]})
    return out


def run(llm: LLM, reqs, params):
    outs = llm.generate(reqs, params)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
             [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs]) for o in outs]


def test_proposer_finds_the_latest_match():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1))
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]) == [7, 5, 1]  # the later of two matches
    assert p.propose([4, 5, 6]) == []
    assert p.propose([8, 1, 8], k=2) == [1, 8]


def test_proposer_prefers_the_match_with_the_longest_context():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=2))
    # [1, 2] follows [5, 6] the first time, as it does at the end: that place wins over the later one
    assert p.propose([5, 6, 1, 2, 7, 9, 1, 2, 8, 5, 6, 1, 2]) == [7, 9, 1]


TEXTS = ["x", "\n", "b", " b", " c", " d", " e", "y", "b\n", "\ufffd", "\ufffd"]


def test_word_classes():
    cls = word_classes(TEXTS)
    assert cls[1] == -1  # whitespace only
    assert cls[2] == cls[3] == cls[8] >= 0  # "b", " b", "b\n"
    assert len({cls[0], cls[2], cls[4], cls[9], cls[10]}) == 5  # partial characters are never alike


def test_proposer_matches_words_across_whitespace():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2), TEXTS)
    source = [0, 1, 2, 4, 5, 6, 7]  # "x\nb c d e y"
    assert p.propose(source + [0, 3, 4]) == [5, 6, 7]  # "x b c": the line break became a space
    assert NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2)) \
        .propose(source + [0, 3, 4]) == []  # token ids alone lose the place
    # ending in whitespace already: the source's own whitespace is not proposed again
    assert p.propose([0, 4, 1, 2, 5] + [0, 4, 1]) == [2, 5, 0]
    assert p.propose([0, 4, 8, 5] + [0, 4]) == [8, 5, 0]


def spec_config(method: str, make_hf_model) -> dict:
    """ngram; a draft that is the target itself (every greedy guess right: long accepted runs);
    another tiny random model with the same vocabulary (guesses mostly wrong: rejections)."""
    if method == "ngram":
        return NGRAM
    draft = make_hf_model("llama")[1] if method == "draft_self" else make_hf_model("llama", tie=True)[1]
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "verify_cost": 0.0}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_other"])
def test_same_tokens_and_logprobs_with_and_without_speculation(llama_dir, make_hf_model, sampling, method):
    config = spec_config(method, make_hf_model)
    reqs = prompts(32)
    params = [SamplingParams(temperature=0.0 if sampling == "greedy" else 0.3, seed=None if sampling == "greedy" else i,
                             max_tokens=10 + 7 * (i % 5), logprobs=2, ignore_eos=True,
                             stop=["zz"] if i % 7 == 3 else None) for i in range(32)]
    pool = 20 * 16 * 512  # 20 blocks of 16 tokens (512 bytes a token here): too few for 32 at once
    base = LLM(llama_dir, max_num_batched_tokens=48, kv_cache_memory=pool)
    spec = LLM(llama_dir, max_num_batched_tokens=48, kv_cache_memory=pool,
               speculative_config={**config, "disable_by_batch_size": 64})
    expected = run(base, reqs, params)
    assert run(spec, reqs, params) == expected  # all 32 at once: batching, chunked prefill
    assert spec.engine.spec_accepted > 0, "no guess was ever accepted: the test would prove nothing"
    assert spec.engine.scheduler.num_preemptions > 0
    if method != "ngram":  # every draft block is given back once nothing runs
        assert spec.engine.proposer.blocks.num_used == 0 and not spec.engine.proposer.seqs
    if method == "draft_other":
        assert spec.engine.spec_accepted < spec.engine.spec_proposed / 2
    alone = LLM(llama_dir, speculative_config=config)
    for i in (0, 5, 13):
        assert run(alone, [reqs[i]], params[i]) == [expected[i]]


def test_default_model_greedy_identity(default_gguf):
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    prompt = [{"role": "user", "content": f"Repeat this code exactly:\n{text}"}]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=1)
    base = LLM(default_gguf).chat(prompt, params)[0].outputs[0]
    spec = LLM(default_gguf, speculative_config=NGRAM)
    out = spec.chat(prompt, params)[0].outputs[0]
    assert out.token_ids == base.token_ids
    assert [{k: v.logprob for k, v in d.items()} for d in out.logprobs] == \
           [{k: v.logprob for k, v in d.items()} for d in base.logprobs]
    assert spec.engine.spec_accepted > 0


def test_default_model_drafting_for_itself(default_gguf):
    """The default model as its own draft: every greedy guess is right, so each step accepts
    all k guesses and the bonus token; the output and its logprobs are the plain engine's."""
    prompt = [{"role": "user", "content": "Name three colours."}]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=1)
    base = LLM(default_gguf).chat(prompt, params)[0].outputs[0]
    # verify_cost 0: guesses always asked for (a draft as big as its target never pays for itself)
    spec = LLM(default_gguf, speculative_config={"method": "draft_model", "model": str(default_gguf),
                                                 "num_speculative_tokens": 4, "verify_cost": 0.0})
    result = spec.chat(prompt, params)[0]
    out = result.outputs[0]
    assert out.token_ids == base.token_ids
    assert [{k: v.logprob for k, v in d.items()} for d in out.logprobs] == \
           [{k: v.logprob for k, v in d.items()} for d in base.logprobs]
    e = spec.engine
    assert e.spec_accepted == e.spec_proposed > 0
    assert e.total_steps <= 2 + len(out.token_ids) // 5 + 1  # prefill, then k + 1 tokens a step
    # the figures, per request and for the engine: every guess accepted, ~k a check
    stats = result.stats[0].as_dict()
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_proposed_tokens"] == e.spec_proposed
    assert 3.0 < stats["spec_mean_accepted_tokens"] <= 4.0
    m = e.metrics()
    assert m["spec_acceptance_rate"] == 1.0 and m["spec_mean_accepted_tokens"] == stats["spec_mean_accepted_tokens"]


def test_metrics_endpoint_reports_speculation(llama_dir):
    """/metrics of a server speculating with a draft that is the target: guesses checked and
    accepted, the acceptance rate and the mean accepted length."""
    import json

    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    from server_utils import run_server

    config = json.dumps({"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3,
                         "verify_cost": 0.0})  # a draft as big as its target: guesses asked for anyway
    with run_server(["--model", str(llama_dir), "--speculative-config", config, "--log-level", "warning"]) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a b c", "max_tokens": 24, "temperature": 0,
                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                   for s in f.samples}
    assert samples["nanoinfer_spec_decode_num_draft_tokens_total"] > 0
    assert samples["nanoinfer_spec_decode_num_accepted_tokens_total"] > 0
    assert 0.0 < samples["nanoinfer_spec_decode_acceptance_rate"] <= 1.0
    assert samples["nanoinfer_spec_decode_mean_accepted_tokens"] > 0


def test_bad_config_is_a_clear_error(llama_dir):
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        LLM(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(InvalidRequestError, match="method"):
        LLM(llama_dir, speculative_config={"method": "medusa"})
    with pytest.raises(InvalidRequestError):
        LLM(llama_dir, speculative_config={"method": "draft_model"})  # no model
    with pytest.raises(Exception, match="no such file"):
        LLM(llama_dir, speculative_config={"method": "draft_model", "model": "/nonexistent/draft"})


class FixedStepTimes(StepTimes):
    """Step times set by the test (the tiny model's real ones are all overhead, and noisy)."""

    def observe(self, rows: int, seconds: float) -> None:
        pass


def test_a_sequence_whose_guesses_miss_stops_guessing(llama_dir):
    """Sampled at temperature 1 the random model rarely picks the looked-up token: where a row
    costs 0.45 of a step, after a few misses the sequence guesses again only every
    retry_after steps; where rows are nearly free, it goes on guessing for longer."""
    proposed = {}
    for extra_row_cost in (0.45, 0.01):
        llm = LLM(llama_dir, speculative_config={**NGRAM, "retry_after": 16})
        e = llm.engine
        e.step_times = FixedStepTimes({rows: 1.0 + extra_row_cost * (rows - 1) for rows in range(1, 10)})
        motif = [7, 8, 9, 10]
        out = llm.generate({"prompt_token_ids": motif * 8},
                           SamplingParams(temperature=1.0, seed=3, max_tokens=64, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 64
        assert e.spec_accepted < e.spec_proposed / 2
        proposed[extra_row_cost] = e.spec_proposed
    assert 0 < proposed[0.45] <= 4 * (3 + 64 // 16)  # a few early tries, then one every 16 steps
    assert proposed[0.01] > 2 * proposed[0.45]


def test_sampled_distribution_is_the_targets(llama_dir):
    """The second sampled token (the first one a guess can decide) over 1500 seeds, with
    speculation, against its exact distribution under the target, sum over t1 of
    p(t1) p(t2 | t1) at temperature 0.5: total variation within what 1500 exact draws from the
    target give (simulated). Every row guesses the same token; accepting every guess instead
    would put all the mass there, far outside that bound."""
    from nanoinfer.models.batch import ForwardBatch

    T, N = 0.5, 1500
    prompt = [41, 42, 43, 41, 42, 43, 41, 42, 43, 41, 42]
    llm = LLM(llama_dir, max_num_seqs=256, max_num_batched_tokens=2048,
              speculative_config={**NGRAM, "disable_by_batch_size": 10 ** 6, "verify_cost": 0.0})

    class Guess43:  # every decoding row guesses 43 for its next token, whatever came before
        def propose_many(self, requests):
            return [[43][:k] for _, _, k in requests]

        def retain(self, keys):
            pass

        def prefill(self, requests):
            pass

    llm.engine.proposer = Guess43()
    outs = llm.generate([{"prompt_token_ids": prompt}] * N,
                        [SamplingParams(temperature=T, seed=s, max_tokens=3, ignore_eos=True) for s in range(N)])
    assert llm.engine.spec_proposed > 0
    second = torch.tensor([o.outputs[0].token_ids[1] for o in outs])
    model = llm.loaded.model
    with torch.inference_mode():
        p1 = torch.softmax(model(ForwardBatch.whole(torch.tensor(prompt)))[-1].double() / T, -1)
        candidates = torch.nonzero(p1 > 1e-6).flatten().tolist()
        target = torch.zeros_like(p1)
        for t1 in candidates:
            p2 = torch.softmax(model(ForwardBatch.whole(torch.tensor(prompt + [t1])))[-1].double() / T, -1)
            target += p1[t1] * p2
    empirical = torch.bincount(second, minlength=len(target)).double() / N
    tv = 0.5 * (empirical - target).abs().sum().item()
    # The threshold: how far N exact draws from the target land from it (20 trials, the
    # largest, with 25% to spare); an exact sampler passes, a biased one does not.
    g = torch.Generator().manual_seed(0)
    noise = max(0.5 * (torch.bincount(torch.multinomial(target, N, replacement=True, generator=g),
                                      minlength=len(target)).double() / N - target).abs().sum().item()
                for _ in range(20))
    assert tv < 1.25 * noise, (tv, noise)
    naive = empirical.clone()  # accepting every guess: every row's second token is 43
    naive[:] = 0
    naive[43] = 1.0
    assert 0.5 * (naive - target).abs().sum().item() > 3 * noise


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_constrained_rows_speculate_exactly(default_gguf, sampling):
    """Rows under JSON schemas speculate too: each verified position is masked with the
    grammar's state after the guesses before it, guesses the grammar forbids are dropped, and
    the budget rule's last stretch is left alone. Same tokens and logprobs as without."""
    import json

    from nanoinfer.sampling import StructuredOutputsParams
    from test_structured_outputs import PROMPT, SCHEMAS

    picked = [(n, s) for n, s in SCHEMAS if n in ("Polygon", "Recipe")]
    prompts = [[{"role": "user", "content": PROMPT.format(n, json.dumps(s))}] for n, s in picked]
    params = [SamplingParams(temperature=0 if sampling == "greedy" else 0.8, seed=None if sampling == "greedy" else 3,
                             max_tokens=300, logprobs=1, structured_outputs=StructuredOutputsParams(json=s))
              for _, s in picked]

    def outputs(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                 [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                for o in llm.chat(prompts, params)]

    base = outputs(LLM(default_gguf))
    spec = LLM(default_gguf, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    assert outputs(spec) == base
    assert spec.engine.spec_accepted > 5  # guesses were taken (10 seeded, more greedy): the equality above means something
    assert all(reason == "stop" for _, reason, _ in base)


class ScriptedToolUser(torch.nn.Module):
    """Next token = script[input token] (else the script's first token): a cycle that calls the
    calculator, `<|python_start|>2+3<|python_end|>`, then writes on."""

    def __init__(self, config, script: dict[int, int], first: int):
        super().__init__()
        self.config, self.script, self.first = config, script, first
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, batch):
        ids = batch.input_ids if batch.logits_indices is None else batch.input_ids[batch.logits_indices]
        logits = torch.zeros(len(ids), self.config.vocab_size)
        for row, t in enumerate(ids.tolist()):
            logits[row, self.script.get(t, self.first)] = 10.0
        return logits


def test_tool_calls_under_speculation():
    """A nanochat vocabulary, a model that calls the calculator in a loop, and n-gram guesses
    that run across the call (the guesses repeat earlier rounds, forced output included): the
    tool state machine sees exactly the accepted tokens, so the tokens and their mask (1 sampled,
    0 forced) are the same with speculation as without."""
    from nanoinfer.config import ModelConfig
    from nanoinfer.engine import EngineConfig, LLMEngine
    from nanoinfer.models.builder import LoadedModel
    from nanoinfer.tokenizer import NanochatTokenizer

    from nanochat_fixtures import build_encoding

    tok = NanochatTokenizer(build_encoding())
    enc = [tok.encode(t, add_special_tokens=False)[0] for t in ("a", "2", "+", "3", "b")]
    a, two, plus, three, b = enc
    start, end = tok.token_to_id("<|python_start|>"), tok.token_to_id("<|python_end|>")
    out_end = tok.token_to_id("<|output_end|>")
    script = {a: start, start: two, two: plus, plus: three, three: end, out_end: b, b: a}
    config = ModelConfig("scripted", tok.vocab_size, 8, 16, 1, 1, 1, 8, max_position_embeddings=256)

    def run(spec):
        engine = LLMEngine(LoadedModel(ScriptedToolUser(config, script, a), tok, config, None, "scripted", 0.0),
                           EngineConfig(speculative_config=spec))
        assert engine.tools
        engine.add_request("r", [a, b], SamplingParams(temperature=0, max_tokens=60))
        while engine.has_unfinished():
            engine.step()
        out = engine.release("r").outputs[0]
        return out.token_ids, out.token_masks, engine

    base_ids, base_mask, _ = run(None)
    ids, mask, engine = run({**NGRAM, "verify_cost": 0.0})
    assert (ids, mask) == (base_ids, base_mask)
    assert base_mask.count(0) >= 9  # at least three calls answered: <|output_start|> 5 <|output_end|>
    assert engine.spec_accepted > 10


def test_guesses_checked_follow_their_worth():
    """No guess pays while a guess is accepted less often than it costs; more guesses pay as the
    acceptance rate nears 1; cheap checks pay sooner."""
    from nanoinfer.spec_decode import updated_accept_rate, worth_checking

    linear = [1 + 0.45 * k for k in range(9)]
    assert worth_checking(0.4, linear) == 0
    assert worth_checking(0.5, linear) == 1
    ks = [worth_checking(a / 100, linear) for a in range(0, 101, 5)]
    assert ks == sorted(ks) and ks[-1] == 8 and 2 <= worth_checking(0.9, linear) < 8
    assert worth_checking(0.99, linear) > worth_checking(0.99, [1 + 0.9 * k for k in range(9)])  # dearer: fewer
    cheap = [1.0, 1.05, 1.1, 1.15]  # nearly free checks (a step bound by its weight reads)
    assert worth_checking(0.5, cheap) == 3 and worth_checking(0.3, cheap) == 2 and worth_checking(0.3, linear) == 0
    # measured: 2 rows cost 1.2 times 1 row; 3 and 4 rows are not measured yet and take the prior
    times = StepTimes()
    times.observe(1, 0.050)
    times.observe(2, 0.060)
    times.observe(1, 0.060)  # a running mean: 0.8 * 0.050 + 0.2 * 0.060
    assert times.seconds[1] == 0.8 * 0.050 + 0.2 * 0.060
    costs = times.step_costs(1, 3, 0.45, 0.0)
    assert costs[0] == 1.0 and costs[1] == 0.060 / times.seconds[1] and costs[2:] == [1.9, 1 + 0.45 * 3]
    assert times.step_costs(1, 1, 0.45, 0.3) == [1.0, 0.060 / times.seconds[1] + 0.3]  # a draft's own forward
    times.observe(3, 0.040)  # noise below the base: never cheaper than no guesses
    assert times.step_costs(1, 2, 0.45, 0.0)[2] == 1.0
    # 2 of 3 accepted then one rejected: 2 of the 3 it reached; all 3 accepted: 3 of 3
    assert updated_accept_rate(1.0, 2, 3) == 0.7 + 0.3 * 2 / 3
    assert updated_accept_rate(0.5, 3, 3) == 0.7 * 0.5 + 0.3
    assert updated_accept_rate(0.5, 0, 0) == 0.5
