"""The benchmark suite: accounting against hand arithmetic, the peak table and probe
cache, and each bench command end to end on a tiny model (figures are not asserted:
they depend on the machine)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from nanoinfer.bench import peaks as peaks_mod
from nanoinfer.bench import roofline as rl
from nanoinfer.bench.cli import add_bench_parser, main
from nanoinfer.config import ModelConfig
from nanoinfer.models.llama import LlamaForCausalLM


def tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=4)
    return ModelConfig(**{**base, **kw})


def roofline_for(config: ModelConfig, dtype=torch.float32) -> rl.Roofline:
    with torch.device("meta"):  # shapes and dtypes only: nothing is allocated
        model = LlamaForCausalLM(config).to(dtype)
    return rl.Roofline.for_model(model, config)


# --- accounting ------------------------------------------------------------------------
def test_matmul_params_and_weight_bytes_untied():
    c = tiny_config()
    # per layer: q 16*16 + k 16*8 + v 16*8 + o 16*16 + MLP 3*16*32 = 256+128+128+256+1536 = 2304
    # two layers 4608, LM head 16*100 = 1600
    assert rl.matmul_params(c) == 4608 + 1600 == 6208
    w = roofline_for(c).weights
    # body: the layer matmuls plus 5 norms of 16 (two per layer, one final), fp32
    assert w.body == (4608 + 5 * 16) * 4 == 18752
    assert w.lm_head == 1600 * 4 == 6400
    assert w.embedding == 100 * 16 * 4 == 6400
    assert w.embedding_row == 16 * 4 == 64
    assert w.total == 18752 + 6400 + 6400 == 31552


def test_weight_bytes_tied_counts_the_table_once_as_lm_head():
    w = roofline_for(tiny_config(tie_word_embeddings=True)).weights
    assert (w.embedding, w.embedding_row, w.lm_head, w.body) == (0, 0, 6400, 18752)
    assert w.total == 25152


def test_nanochat_accounting():
    from nanoinfer.models.nanochat import NanochatGPT

    c = tiny_config(architecture="nanochat", layer_windows=[4, None],
                    extra={"padded_vocab": 128, "ve_layers": [1], "ve_gate_channels": 12, "ve_gate_scale": 3.0})
    # per layer: q 256 + k 128 + v 128 + o 256 + a relu^2 MLP of two matrices 2*16*32 = 1792;
    # the LM head over the padded vocab: 16*128
    assert rl.matmul_params(c) == 2 * 1792 + 16 * 128 == 5632
    with torch.device("meta"):
        model = NanochatGPT(c)
    w = rl.model_weight_bytes(model, c)
    # lookups: wte 128x16 and layer 1's value embedding 128x8 (kv heads 2 x head_dim 4); a token reads a row of each
    assert w.embedding == (128 * 16 + 128 * 8) * 4
    assert w.embedding_row == (16 + 8) * 4
    assert w.lm_head == 128 * 16 * 4
    # body: 2 x 768 attention + 2 x 1024 MLP, the 12->2 VE gate, two fp32 lambdas per layer
    assert w.body == (2 * 768 + 2 * 1024 + 12 * 2 + 2 * 2) * 4
    # the short window caps layer 0's keys: 4 + 10 keys of 64 bytes
    assert rl.kv_bytes_read(c, 10, 4) == 64 * (4 + 10)


def test_weight_bytes_follow_the_served_dtype():
    w = roofline_for(tiny_config(), torch.bfloat16).weights
    assert w.total == 31552 // 2
    assert roofline_for(tiny_config(), torch.bfloat16).kv_bytes_per_token == 64


def test_kv_bytes_per_token_and_read_with_and_without_window():
    c = tiny_config()
    # layers 2 x (K and V) 2 x kv heads 2 x head_dim 4 x 4 bytes
    assert c.kv_bytes_per_token(4) == 2 * 2 * 2 * 4 * 4 == 128
    per_key = 2 * 2 * 4 * 4  # one layer, one key: K and V, fp32 = 64 bytes
    assert rl.kv_bytes_read(c, 10, 4) == 2 * per_key * 10 == 1280
    assert rl.kv_bytes_read(tiny_config(sliding_window=4), 10, 4) == 2 * per_key * 4 == 512
    assert rl.kv_bytes_read(tiny_config(sliding_window=4), 3, 4) == 2 * per_key * 3  # window not yet full
    # per-layer windows (nanochat's short/long pattern): 4 keys in layer 0, all 10 in layer 1
    assert rl.kv_bytes_read(tiny_config(layer_windows=[4, None]), 10, 4) == per_key * 4 + per_key * 10 == 896


def test_decode_flops_per_token():
    # 2 x matmul params + layers x 4 x heads x head_dim x keys seen
    assert rl.decode_flops_per_token(tiny_config(), 10) == 2 * 6208 + 2 * (4 * 4 * 4) * 10 == 13696
    assert rl.decode_flops_per_token(tiny_config(sliding_window=4), 10) == 12416 + 2 * 64 * 4 == 12928


def test_prefill_flops_causal_sum():
    # 5 tokens: layer matmuls for every token, LM head for the last only, query i sees i keys
    body = 2 * 4608 * 5
    head = 2 * 1600
    assert rl.prefill_flops(tiny_config(), 5) == body + head + 2 * 64 * (1 + 2 + 3 + 4 + 5) == 51200
    # window 3: the queries see 1, 2, 3, 3, 3 keys
    assert rl.prefill_flops(tiny_config(sliding_window=3), 5) == body + head + 2 * 64 * 12 == 50816
    # after 2 cached tokens, the 3 new queries see 3, 4, 5 keys
    assert rl.prefill_flops(tiny_config(), 3, past=2) == 2 * 4608 * 3 + head + 2 * 64 * 12


@pytest.mark.parametrize("window", [None, 1, 3, 7, 50])
def test_sum_keys_matches_brute_force(window):
    for first in range(1, 12):
        for last in range(first - 1, 20):
            want = sum(c if window is None else min(c, window) for c in range(first, last + 1))
            assert rl._sum_keys(first, last, window) == want


def test_decode_step_bytes_tied_and_untied():
    untied, tied = roofline_for(tiny_config()), roofline_for(tiny_config(tie_word_embeddings=True))
    # untied: body + LM head once, then per sequence one embedding row and its KV
    assert untied.decode_step_bytes(3, 10) == 18752 + 6400 + 3 * (64 + 1280) == 29184
    # tied: the table is read whole as the LM head, so no extra rows
    assert tied.decode_step_bytes(3, 10) == 18752 + 6400 + 3 * 1280 == 28992
    assert untied.decode_step_flops(3, 10) == 3 * 13696
    assert untied.prefill_bytes(2, 5) == 25152 + 2 * 5 * (64 + 128)


def test_ceiling_and_compute_bound_batch():
    r = roofline_for(tiny_config())
    assert r.batch1_ceiling(1e5, 10) == pytest.approx(1e5 / (25152 + 1344))
    # B * 13696 / 1e6 = (25152 + B * 1344) / 1e5  =>  B = 0.25152 / (0.013696 - 0.01344)
    b = r.compute_bound_batch(1e6, 1e5, 10)
    assert b == pytest.approx(0.25152 / 0.000256)
    assert b * 13696 / 1e6 == pytest.approx((25152 + b * 1344) / 1e5)
    # compute so fast that per-sequence KV traffic always dominates: never compute-bound
    assert r.compute_bound_batch(1e12, 1e5, 10) is None


# --- peaks -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,label", [
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA GeForce RTX 3090", "RTX 3090"), ("NVIDIA B200", "B200"),
    ("AMD Instinct MI300X", "MI300X"),
])
def test_gpu_table_matches_names(name, label):
    assert peaks_mod.table_peaks(name, torch.bfloat16)[2] == label


def test_gpu_table_values_by_dtype():
    assert peaks_mod.table_peaks("NVIDIA H100 80GB HBM3", torch.bfloat16)[:2] == (989e12, 3.35e12)
    assert peaks_mod.table_peaks("NVIDIA H100 80GB HBM3", torch.float32)[:2] == (67e12, 3.35e12)
    assert peaks_mod.table_peaks("Some Unknown GPU", torch.bfloat16) is None


def test_probe_runs_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOINFER_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    # the real probes, shrunk so the test stays fast
    assert peaks_mod.measure_bandwidth(cpu, nbytes=1 << 20, budget_s=0.01) > 0
    assert peaks_mod.measure_flops(cpu, torch.float32, n=64, budget_s=0.01) > 0
    calls = []
    monkeypatch.setattr(peaks_mod, "measure_bandwidth", lambda d, n: calls.append("bw") or 2e10)
    monkeypatch.setattr(peaks_mod, "measure_flops", lambda d, dt: calls.append("flops") or 3e11)

    first = peaks_mod.resolve_peaks(cpu, torch.float32)
    assert (first.flops, first.bandwidth, first.source) == (3e11, 2e10, "measured")
    data = json.loads((tmp_path / "peaks.json").read_text())
    assert list(data) == [peaks_mod.cache_key(cpu, torch.float32)]
    assert f"threads={torch.get_num_threads()}" in next(iter(data))
    again = peaks_mod.resolve_peaks(cpu, torch.float32)
    assert (again.flops, again.bandwidth, again.source) == (3e11, 2e10, "cached")
    assert calls == ["bw", "flops"]  # probed once
    peaks_mod.resolve_peaks(cpu, torch.bfloat16)  # another dtype is another entry
    assert len(json.loads((tmp_path / "peaks.json").read_text())) == 2
    peaks_mod.resolve_peaks(cpu, torch.float32, remeasure=True)
    assert len(calls) == 6
    mixed = peaks_mod.resolve_peaks(cpu, torch.float32, peak_flops=1e9)
    assert (mixed.flops, mixed.bandwidth, mixed.source) == (1e9, 2e10, "override / cached")
    both = peaks_mod.resolve_peaks(cpu, torch.float32, peak_flops=1e9, peak_bandwidth=1e8)
    assert both.source == "override" and len(calls) == 6


def test_bandwidth_probe_outgrows_the_last_level_cache(tmp_path, monkeypatch):
    """The CPU probe sums a tensor four times the largest cache sysfs reports (256 MiB at least, 4
    GiB at most), and a cached figure from another probe size is measured again."""
    for name, size in (("index0", "48K"), ("index1", "32K"), ("index2", "2048K"), ("index3", "307200K"),
                       ("index4", "junk")):
        (tmp_path / "cache" / name).mkdir(parents=True)
        (tmp_path / "cache" / name / "size").write_text(size + "\n")
    llc = peaks_mod.last_level_cache_bytes(tmp_path / "cache")
    assert llc == 300 << 20
    assert peaks_mod.last_level_cache_bytes(tmp_path / "none") == 0
    assert peaks_mod.cpu_probe_bytes(0) == peaks_mod.cpu_probe_bytes(32 << 20) == 256 << 20
    assert peaks_mod.cpu_probe_bytes(llc) == 1200 << 20
    assert peaks_mod.cpu_probe_bytes(2 << 30) == 4 << 30

    monkeypatch.setenv("NANOINFER_CACHE_DIR", str(tmp_path / "peaks"))
    cpu = torch.device("cpu")
    calls, sizes = [], []
    monkeypatch.setattr(peaks_mod, "measure_bandwidth", lambda d, n: calls.append("bw") or sizes.append(n) or 2e10)
    monkeypatch.setattr(peaks_mod, "measure_flops", lambda d, dt: calls.append("flops") or 3e11)
    path = tmp_path / "peaks" / "peaks.json"
    path.parent.mkdir()
    path.write_text(json.dumps({peaks_mod.cache_key(cpu, torch.float32): {"flops": 1e11, "bandwidth": 5e10}}))
    fresh = peaks_mod.resolve_peaks(cpu, torch.float32)  # an entry from before probe sizes were kept
    assert (fresh.bandwidth, fresh.source, calls) == (2e10, "measured", ["bw", "flops"])
    entry = json.loads(path.read_text())[peaks_mod.cache_key(cpu, torch.float32)]
    assert entry["probe_bytes"] == peaks_mod.probe_bytes(cpu)
    assert peaks_mod.resolve_peaks(cpu, torch.float32).source == "cached"
    monkeypatch.setattr(peaks_mod, "probe_bytes", lambda d: entry["probe_bytes"] * 2)  # another machine's caches
    assert peaks_mod.resolve_peaks(cpu, torch.float32).source == "measured" and len(calls) == 4
    assert sizes == [entry["probe_bytes"], entry["probe_bytes"] * 2]  # each probe the size its entry keeps


def test_block_models_peak_is_the_8_bit_dot(tmp_path, monkeypatch):
    """A model on GGUF blocks is measured against the 8-bit dot probe, cached apart from the
    matmul peak; where this CPU's path has no probe, the matmul's peak stands in."""
    from nanoinfer.kernels import quant

    monkeypatch.setenv("NANOINFER_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    if quant.paths() and quant.paths()[-1] != "portable":
        quant.set_path("portable")
        try:
            assert quant.dot_peak(0.01) == 0.0  # no probe for plain C++
        finally:
            quant.set_path(None)
        assert quant.dot_peak(0.05) > 1e9  # a real probe: billions of 8-bit products a second
    calls = []
    monkeypatch.setattr(peaks_mod, "measure_bandwidth", lambda d, n: calls.append("bw") or 2e10)
    monkeypatch.setattr(peaks_mod, "measure_flops", lambda d, dt: calls.append("flops") or 3e11)
    monkeypatch.setattr(peaks_mod, "measure_dot_peak", lambda: calls.append("dot") or 9e11)
    block = peaks_mod.resolve_peaks(cpu, torch.float32, block=True)
    assert (block.flops, block.compute) == (9e11, "8-bit dot")
    plain = peaks_mod.resolve_peaks(cpu, torch.float32)
    assert (plain.flops, plain.compute) == (3e11, "matmul")
    assert sorted(json.loads((tmp_path / "peaks.json").read_text())) == sorted(
        [peaks_mod.cache_key(cpu, torch.float32, block=True), peaks_mod.cache_key(cpu, torch.float32)])
    monkeypatch.setattr(peaks_mod, "measure_dot_peak", lambda: 0.0)
    monkeypatch.setenv("NANOINFER_CACHE_DIR", str(tmp_path / "other"))
    assert peaks_mod.resolve_peaks(cpu, torch.float32, block=True).compute == "matmul"


def test_each_path_has_its_own_dot_peak():
    """The 8-bit dot peak is the path's: cached under its name, and on a CPU with the tile unit
    the AMX probe (TDPBSUD) well above the AVX-512 one (vpdpbusd)."""
    from nanoinfer.kernels import quant

    cpu, names = torch.device("cpu"), quant.paths()
    if len(names) < 2:
        pytest.skip("one path on this CPU")
    keys, probes = set(), {}
    try:
        for name in names:
            quant.set_path(name)
            assert quant.path_name() == name
            keys.add(peaks_mod.cache_key(cpu, torch.float32, block=True))
            probes[name] = quant.dot_peak(0.05)
    finally:
        quant.set_path(None)
    assert len(keys) == len(names)
    assert quant.path_name() == quant.default_path()
    if "amx" in probes:
        assert probes["amx"] > 3 * probes["avx512"] > 0


# --- the commands end to end ----------------------------------------------------------
PEAKS = ["--peak-flops", "1e11", "--peak-bandwidth", "1e10"]


def run_bench(capsys, argv: list[str]) -> tuple[dict, str]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1]), out


def assert_png(path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def assert_meta(doc: dict, bench: str) -> None:
    for key in ("model", "device", "dtype", "threads", "versions", "machine"):
        assert key in doc
    assert doc["bench"] == bench and doc["device"] == "cpu" and doc["dtype"] == "float32"
    assert {"torch", "nanoinfer"} <= set(doc["versions"]) and "cpu" in doc["machine"]


def test_bench_latency(make_hf_model, tmp_path, capsys):
    _, path = make_hf_model("llama")
    png = tmp_path / "roofline.png"
    doc, out = run_bench(capsys, ["latency", "--model", str(path), "--prompt-len", "8", "--decode-len", "4",
                                  "--batch-sizes", "1,3", "--plot", str(png), *PEAKS])
    assert_meta(doc, "latency")
    assert doc["peaks"]["source"] == "override"
    for key in ("weight_bytes", "kv_bytes_per_token", "kv_bytes_read_per_seq", "decode_flops_per_token",
                "batch1_ceiling_tok_s", "compute_bound_batch"):
        assert key in doc["card"]
    assert [r["batch_size"] for r in doc["results"]] == [1, 3]
    for r in doc["results"]:
        for key in ("ttft_s", "prefill_tok_s", "prefill_mfu", "tpot_s", "decode_tok_s", "mbu", "mfu",
                    "peak_memory_bytes"):
            assert r[key] > 0
        assert r["decode_steps"] == 3 and r["generated_tokens"] == 4 * r["batch_size"]
    assert "TPOT ms" in out and "ceiling" in out
    assert_png(png)


def test_bench_latency_interleaved(make_hf_model, capsys, monkeypatch):
    from nanoinfer.bench import latency

    _, path = make_hf_model("llama")
    taken = []
    real_step = latency.decode_step

    def logged_step(env, run, decode_len):
        taken.append(run.batch)
        real_step(env, run, decode_len)

    monkeypatch.setattr(latency, "decode_step", logged_step)
    doc, out = run_bench(capsys, ["latency", "--model", str(path), "--prompt-len", "8", "--decode-len", "4",
                                  "--batch-sizes", "1,3", "--interleave", *PEAKS])
    assert doc["interleaved"] is True
    assert [r["batch_size"] for r in doc["results"]] == [1, 3]
    # both prefilled first, then a step of each in turn, the order reversed each round
    assert taken == [1, 3, 3, 1, 1, 3]
    for r in doc["results"]:
        assert r["decode_steps"] == 3 and r["generated_tokens"] == 4 * r["batch_size"] and r["tpot_s"] > 0
    ratio = doc["results"][1]["tpot_s"] / doc["results"][0]["tpot_s"]
    assert f"TPOT against batch 1: batch 3 {ratio:.2f}x" in out


def test_bench_latency_cold_cache(make_hf_model, capsys, monkeypatch):
    """--cold-cache reads its tensor before every timed step, the prefill and each decode step."""
    from nanoinfer.bench import latency

    _, path = make_hf_model("llama")
    monkeypatch.setattr(latency, "cpu_probe_bytes", lambda llc: 1 << 20)  # not the real size in a test
    reads = []
    real_evict = latency.ColdCache.evict
    monkeypatch.setattr(latency.ColdCache, "evict", lambda self: (reads.append(self.buf.numel()), real_evict(self)))
    doc, out = run_bench(capsys, ["latency", "--model", str(path), "--prompt-len", "8", "--decode-len", "4",
                                  "--batch-sizes", "1,3", "--cold-cache", *PEAKS])
    assert doc["cold_cache_bytes"] == 1 << 20 and reads == [(1 << 20) // 4] * 8  # 2 batch sizes x (1 + 3 steps)
    assert "cold cache: 1.0 MiB read before each timed step" in out
    assert [r["decode_steps"] for r in doc["results"]] == [3, 3]


def test_bench_throughput_against_transformers(make_hf_model, tmp_path, capsys):
    _, path = make_hf_model("llama")
    png = tmp_path / "throughput.png"
    doc, out = run_bench(capsys, ["throughput", "--model", str(path), "-n", "5", "--min-input-len", "3",
                                  "--max-input-len", "12", "--min-output-len", "2", "--max-output-len", "6",
                                  "--compare", "transformers", "--hf-batch-size", "2", "--plot", str(png)])
    assert_meta(doc, "throughput")
    assert "transformers" in doc["versions"]
    ni, hf = doc["results"]["nanoinfer"], doc["results"]["transformers"]
    for r in (ni, hf):
        for key in ("output_tok_s", "total_tok_s", "requests_per_s", "wall_s"):
            assert r[key] > 0
        assert r["requests"] == 5
    assert ni["output_tokens"] == hf["output_tokens"]  # the same requests, useful tokens only
    assert hf["batches"] == 3 and hf["generated_tokens_incl_waste"] >= hf["output_tokens"]
    assert doc["ratio_output_tok_s"] == pytest.approx(ni["output_tok_s"] / hf["output_tok_s"])
    assert "nanoinfer / transformers" in out
    assert_png(png)


def test_bench_throughput_structured(make_hf_model, capsys):
    """--structured json: the same requests again, each under the bench's JSON schema; the
    outputs run to their lengths (the schema cannot close early) and the mask time is reported."""
    _, path = make_hf_model("llama")
    doc, out = run_bench(capsys, ["throughput", "--model", str(path), "-n", "4", "--min-input-len", "3",
                                  "--max-input-len", "12", "--min-output-len", "8", "--max-output-len", "16",
                                  "--structured", "json", "--rounds", "3"])
    free, js = doc["results"]["nanoinfer"], doc["results"]["nanoinfer_json"]
    rounds = doc["rounds_output_tok_s"]  # alternated; the table's runs are each side's median
    assert len(rounds) == 3 and free["output_tok_s"] == sorted(f for f, _ in rounds)[1]
    assert js["output_tok_s"] == sorted(c for _, c in rounds)[1]
    assert js["output_tokens"] == free["output_tokens"] and js["closed_early"] == 0
    assert js["structured"] == "json" and js["mask_ms_per_step"] > 0
    assert doc["ratio_structured_output_tok_s"] == pytest.approx(js["output_tok_s"] / free["output_tok_s"])
    assert "under a JSON schema" in out


def test_bench_loop(make_hf_model, tmp_path, capsys):
    _, path = make_hf_model("llama")
    png = tmp_path / "loop.png"
    doc, out = run_bench(capsys, ["loop", "--model", str(path), "--prompt-len", "6", "--output-len", "10",
                                  "--rows", "4", "--plot", str(png)])
    assert_meta(doc, "loop")
    assert doc["uncached"]["forwards"] == 10 and doc["cached"]["steps"] == 10
    assert [c for c, _ in doc["uncached"]["per_forward"]] == list(range(6, 16))
    assert [c for c, _ in doc["cached"]["per_step"]] == list(range(6, 16))
    assert doc["ratio_total"] > 0 and 2 <= len(doc["table"]) <= 4
    assert "uncached/cached" in out
    assert_png(png)


@pytest.fixture
def q8_block_file(make_hf_model, tiny_tokenizer_dir, tmp_path):
    """A tiny Llama written as a Q8_0 GGUF, and the weights `bench linears` should run: every
    block weight, the embedding only where it is the (tied) head."""
    from nanoinfer.kernels import quant
    from nanoinfer.loaders import load_files
    from nanoinfer.tensors import QuantizedTensor

    from gguf_export import write_gguf_from_hf

    if not quant.paths():
        pytest.skip("no compiled kernels")
    model, _ = make_hf_model("llama")
    path = write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "q8.gguf", tensor_type="Q8_0")
    state = load_files(path, dtype=None).state
    tied = "lm_head.weight" not in state
    return path, [t for name, t in state.items() if isinstance(t, QuantizedTensor)
                  and (tied or not name.endswith("embed_tokens.weight"))]


def test_bench_linears(q8_block_file, capsys):
    """Every block weight of the file, by type, once per row count and run; the table's
    figures are the JSON's."""
    path, want = q8_block_file
    doc, out = run_bench(capsys, ["linears", "--model", str(path), "--rows", "1,3", "--runs", "2", "--path", "portable",
                                  "--threads", "1"])
    assert doc["bench"] == "linears" and doc["path"] == "portable" and doc["threads"] == 1 and "cpu" in doc["machine"]
    assert [(r["type"], r["rows"]) for r in doc["results"]] == [("Q8_0", 1), ("Q8_0", 3)]
    for r in doc["results"]:
        assert r["weights"] == len(want) and r["bytes"] == sum(t.data.numel() for t in want)
        assert len(r["seconds_all"]) == 2 and r["seconds"] > 0
    assert doc["results"][0]["vs_first"] == 1.0
    assert f"{doc['results'][1]['vs_first']:.2f}x" in out


def test_bench_linears_by_shape(q8_block_file, capsys):
    """--by shape: one set per type and weight shape, each holding exactly the file's weights of
    that shape; the table names the shape."""
    from collections import Counter

    path, weights = q8_block_file
    want = Counter(tuple(t.shape) for t in weights)
    assert len(want) > 1  # the test means something only with several shapes
    doc, out = run_bench(capsys, ["linears", "--model", str(path), "--rows", "2", "--runs", "1", "--path", "portable",
                                  "--threads", "1", "--by", "shape"])
    assert doc["by"] == "shape"
    got = {tuple(r["shape"]): r["weights"] for r in doc["results"]}
    assert got == dict(want) and len(doc["results"]) == len(want)
    for shape in want:
        assert f"Q8_0 {shape[0]}x{shape[1]}" in out


@pytest.mark.parametrize("weights", ["streamed", "cached"])
def test_bench_linears_weights_from(q8_block_file, capsys, monkeypatch, weights):
    """--weights cached runs each weight 1 + WARM_CALLS times in a row (the last call timed),
    streamed once; each in every run and row count, and the JSON says which."""
    from collections import Counter

    from nanoinfer.bench import linears

    calls = 1 + (linears.WARM_CALLS if weights == "cached" else 0)
    path, want = q8_block_file
    seen, real = Counter(), linears.quant.linear
    monkeypatch.setattr(linears.quant, "linear", lambda x, w, *args, **kw: seen.update([w.data_ptr()]) or real(x, w, *args, **kw))
    doc, out = run_bench(capsys, ["linears", "--model", str(path), "--rows", "1,2", "--runs", "3", "--path", "portable",
                                  "--threads", "1", "--weights", weights])
    assert doc["weights_from"] == weights and f"weights {weights}" in out
    assert len(seen) == len(want) and set(seen.values()) == {2 * 3 * calls}


def test_bench_linears_against(q8_block_file, capsys, monkeypatch):
    """--against: a second build (here the library itself, under its own name) timed beside the
    library in every run, each weight once per build per run and row count after one check of
    its bits; the JSON and the table give both builds' medians and their ratio."""
    from collections import Counter

    from nanoinfer.bench import linears
    from nanoinfer.kernels import cpu_kernels

    path, want = q8_block_file
    built = []
    monkeypatch.setattr(linears.cpu_kernels, "quant_library_with",
                        lambda flags: built.append(flags) or cpu_kernels.library())
    calls, real = Counter(), linears.quant.linear
    monkeypatch.setattr(linears.quant, "linear", lambda x, w, *args, library=None, **kw: calls.update(
        [("against" if library is not None else "this", w.data_ptr())]) or real(x, w, *args, library=library, **kw))
    doc, out = run_bench(capsys, ["linears", "--model", str(path), "--rows", "1,2", "--runs", "3", "--path", "portable",
                                  "--threads", "1", "--against=-DQG_SOMETHING=1"])
    assert built == ["-DQG_SOMETHING=1"] and doc["against"] == "-DQG_SOMETHING=1"
    # per weight and build: 3 runs x 2 row counts timed, and the bit check's call at each row count
    assert len(calls) == 2 * len(want) and set(calls.values()) == {3 * 2 + 2}
    for r in doc["results"]:
        assert len(r["against_seconds_all"]) == 3 and r["against_seconds"] > 0
        assert r["against_vs_this"] == pytest.approx(r["against_seconds"] / r["seconds"])
        assert f"{r['against_vs_this']:.2f}x" in out
    assert "against / this" in out and "against the build with '-DQG_SOMETHING=1' added" in out


def test_bench_linears_against_a_build_that_changes_bits(q8_block_file, capsys, monkeypatch):
    """Two builds whose outputs differ in one bit: an error naming the weight, before any timing."""
    from nanoinfer.bench import linears
    from nanoinfer.kernels import cpu_kernels

    path, _ = q8_block_file
    monkeypatch.setattr(linears.cpu_kernels, "quant_library_with", lambda flags: cpu_kernels.library())
    real = linears.quant.linear

    def off_by_one_ulp(x, w, *args, library=None, **kw):
        y = real(x, w, *args, library=library, **kw)
        return torch.nextafter(y, torch.full_like(y, float("inf"))) if library is not None else y

    monkeypatch.setattr(linears.quant, "linear", off_by_one_ulp)
    assert main(["linears", "--model", str(path), "--rows", "1", "--runs", "1", "--path", "portable",
                 "--against=-DQG_SOMETHING=1"]) == 1
    err = capsys.readouterr().err
    assert "the two builds' outputs differ (Q8_0" in err and "1 rows" in err


def test_bench_linears_against_a_build_without_the_path(q8_block_file, capsys, monkeypatch):
    """A path named (--path) that the second build lacks: a one-line error, not a failed call."""
    from types import SimpleNamespace

    from nanoinfer.bench import linears

    path, _ = q8_block_file
    monkeypatch.setattr(linears.cpu_kernels, "quant_library_with",
                        lambda flags: SimpleNamespace(quant_paths=lambda: 0))  # no path at all
    assert main(["linears", "--model", str(path), "--runs", "1", "--path", "portable", "--against=-DQG_SOMETHING=1"]) == 1
    assert "--against: the build with '-DQG_SOMETHING=1' added has no portable path" in capsys.readouterr().err


def test_bench_verify(make_hf_model, capsys, monkeypatch):
    """Forwards of R rows of the one prefilled sequence at the position after its prompt (its
    token and R - 1 guesses), each row count in turn, the order reversed each round; the
    table's figures are the JSON's."""
    from nanoinfer.engine.runner import ModelRunner

    _, path = make_hf_model("llama")
    forwards = []
    real_run = ModelRunner.run

    def logged_run(self, batch):
        seq = batch.seqs[0]
        forwards.append((len(batch.seqs), batch.num_tokens[0], seq.kv.num_computed, len(seq.spec.tokens)))
        return real_run(self, batch)

    monkeypatch.setattr(ModelRunner, "run", logged_run)
    doc, out = run_bench(capsys, ["verify", "--model", str(path), "--rows", "1,3", "--prompt-len", "20",
                                  "--rounds", "3"])
    assert_meta(doc, "verify")
    assert doc["prompt_len"] == 20 and doc["rounds"] == 3
    assert forwards[0] == (1, 20, 0, 0)  # the prefill, then the timed forwards
    assert forwards[1:] == [(1, r, 20, r - 1) for r in (1, 3, 3, 1, 1, 3)]
    assert [r["rows"] for r in doc["results"]] == [1, 3]
    for r in doc["results"]:
        assert len(r["seconds_all"]) == 3 and r["seconds"] == sorted(r["seconds_all"])[1]
    assert doc["results"][0]["vs_first"] == 1.0
    assert f"{doc['results'][1]['vs_first']:.2f}x" in out


def test_bench_verify_past_the_context(make_hf_model, capsys):
    _, path = make_hf_model("llama")
    assert main(["verify", "--model", str(path), "--prompt-len", "100000", "--rows", "1,4"]) == 1
    assert "passes the model's context" in capsys.readouterr().err


def test_bench_linears_needs_block_weights(make_hf_model, capsys):
    _, path = make_hf_model("llama")  # a Hugging Face folder: float32 weights, no blocks
    assert main(["linears", "--model", str(path), "--runs", "1"]) == 1
    assert "no weight runs in a block kernel" in capsys.readouterr().err

@pytest.mark.parametrize("argv,message", [
    (["latency", "--batch-sizes", "1,x"], "--batch-sizes"),
    (["latency", "--batch-sizes", "0"], ">= 1"),
    (["latency", "--decode-len", "1"], "--decode-len"),
    (["latency", "--batch-sizes", "4", "--interleave"], "--interleave"),
    (["latency", "--cold-cache", "--compare", "llama.cpp"], "--cold-cache"),
    (["linears", "--rows", "1,0"], "--rows"),
    (["linears", "--runs", "0"], "--runs"),
    (["linears", "--against=-DX='a b"], "the added flags: no closing quotation"),
    (["linears", "--against=--no-such-compiler-option"], "building the kernels with '--no-such-compiler-option' added failed"),
    (["throughput", "--min-input-len", "9", "--max-input-len", "3"], "min <= max"),
    (["loop", "--plot", "out.jpg"], ".png"),
    (["verify", "--rows", "2,0"], "--rows"),
    (["verify", "--rounds", "0"], "--rounds"),
    (["verify", "--prompt-len", "0"], "--prompt-len"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    # checked before any model loads
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]


def test_add_bench_parser_hooks_into_a_cli():
    p = argparse.ArgumentParser(prog="nanoinfer")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    for cmd in ("latency", "throughput", "loop"):
        args = p.parse_args(["bench", cmd, "--model", "x.gguf"])
        assert callable(args.func) and args.model == "x.gguf"


@pytest.mark.parametrize("command", ["latency", "throughput", "loop", "sampler", "linears", "verify"])  # those that run a model
def test_bench_threads_must_be_positive(command, capsys):
    p = argparse.ArgumentParser(prog="nanoinfer")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    assert p.parse_args(["bench", command, "--threads", "3"]).threads == 3
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["bench", command, "--threads", bad])
    assert "--threads" in capsys.readouterr().err


# --- bench latency --compare llama.cpp, against a stand-in llama_cpp module ----------------
# A real subprocess of this interpreter runs the bench's llama.cpp script; PYTHONPATH puts a
# stub `llama_cpp` first, which sleeps a little per token and logs what it was asked.
STUB_LLAMA_CPP = '''
import json, os, time
__version__ = "0.0-stub"


def _log(entry):
    with open(os.environ["STUB_LLAMA_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_batch, verbose):
        assert os.path.isfile(model_path) and not verbose
        self.n_ctx, self.n_tokens = n_ctx, 0
        _log({"engine": "llama.cpp", "threads": [n_threads, n_threads_batch], "n_batch": n_batch})

    def reset(self):
        self.n_tokens = 0

    def eval(self, ids):
        self.n_tokens += len(ids)
        assert self.n_tokens <= self.n_ctx
        if len(ids) > 1:
            _log({"eval": list(ids)})
        time.sleep(0.0005 * len(ids))

    def sample(self, top_k, temp):
        assert top_k == 1 and temp == 0.0  # greedy
        return 7
'''


@pytest.fixture
def stub_llama_cpp(tmp_path, monkeypatch):
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "llama_cpp.py").write_text(STUB_LLAMA_CPP)
    log = tmp_path / "llama.log"
    log.touch()
    monkeypatch.setenv("PYTHONPATH", str(stub))
    monkeypatch.setenv("STUB_LLAMA_LOG", str(log))
    monkeypatch.delenv("NANOINFER_LLAMA_CPP_PYTHON", raising=False)
    return log


@pytest.fixture
def tiny_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path):
    from gguf_export import write_gguf_from_hf
    model, _ = make_hf_model("llama")
    return write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "tiny.gguf"), model.config.vocab_size


def test_bench_latency_compare_llama_cpp(stub_llama_cpp, tiny_gguf, capsys, monkeypatch):
    import random
    import statistics
    import sys

    from nanoinfer.bench import latency
    from nanoinfer.bench.common import random_prompt

    path, vocab = tiny_gguf
    real_run_batch = latency.run_batch

    def logged_run_batch(*a, **kw):
        with open(stub_llama_cpp, "a") as f:
            f.write(json.dumps({"engine": "nanoinfer"}) + "\n")
        return real_run_batch(*a, **kw)

    monkeypatch.setattr(latency, "run_batch", logged_run_batch)
    monkeypatch.setenv("NANOINFER_LLAMA_CPP_PYTHON", sys.executable)  # the interpreter from the environment
    doc, out = run_bench(capsys, ["latency", "--model", str(path), "--prompt-len", "8", "--decode-len", "5",
                                  "--compare", "llama.cpp", "--runs", "3", "--threads", "1", *PEAKS])
    assert_meta(doc, "latency")
    assert [r["batch_size"] for r in doc["results"]] == [1]  # --compare: batch 1 by default

    log = [json.loads(x) for x in stub_llama_cpp.read_text().splitlines()]
    engines = [e["engine"] for e in log if "engine" in e]
    # the table's batch 1, then three rounds, the first engine alternating
    assert engines == ["nanoinfer", "nanoinfer", "llama.cpp", "llama.cpp", "nanoinfer", "nanoinfer", "llama.cpp"]
    assert all(e["threads"] == [1, 1] and e["n_batch"] == 512 for e in log if e.get("engine") == "llama.cpp")
    # llama.cpp gets our prompt ids: a warm-up on the first 8 at most, then the timed prefill
    ours = random_prompt(random.Random(0 + 1), 8, vocab)
    assert [e["eval"] for e in log if "eval" in e] == [ours, ours] * 3

    c = doc["compare"]
    assert (c["engine"], c["version"], c["python"]) == ("llama.cpp", "0.0-stub", sys.executable)
    assert (c["batch_size"], c["prompt_len"], c["decode_len"], c["threads"]) == (1, 8, 5, 1)
    assert c["model"] == str(path) and c["cpu"] == doc["machine"]["cpu"]
    assert [r["run"] for r in c["runs"]] == [1, 2, 3]
    assert [r["order"][0] for r in c["runs"]] == ["nanoinfer", "llama_cpp", "nanoinfer"]
    keys = {"prefill_tok_s", "decode_tok_s", "decode_tok_s_mean", "ttft_s", "tpot_s"}
    for r in c["runs"]:
        assert r["llama_cpp"]["decode_steps"] == 4 and r["llama_cpp"]["load_s"] >= 0
        for who in ("nanoinfer", "llama_cpp"):
            assert keys <= set(r[who]) and all(r[who][k] > 0 for k in keys)
        assert r["ratio"]["decode"] == pytest.approx(r["nanoinfer"]["decode_tok_s"] / r["llama_cpp"]["decode_tok_s"])
        assert r["ratio"]["prefill"] == pytest.approx(r["nanoinfer"]["prefill_tok_s"]
                                                      / r["llama_cpp"]["prefill_tok_s"])
    for who in ("nanoinfer", "llama_cpp"):
        for k in keys:
            assert c["median"][who][k] == pytest.approx(statistics.median(r[who][k] for r in c["runs"]))
    m = c["median"]
    assert c["ratio"]["decode"] == pytest.approx(m["nanoinfer"]["decode_tok_s"] / m["llama_cpp"]["decode_tok_s"])
    assert c["ratio"]["prefill"] == pytest.approx(m["nanoinfer"]["prefill_tok_s"] / m["llama_cpp"]["prefill_tok_s"])
    assert "against llama.cpp 0.0-stub" in out and "median" in out


def test_compare_several_files_and_prompt_lengths(stub_llama_cpp, tiny_gguf, capsys, monkeypatch, tmp_path):
    """--also adds files and --prompt-len takes a list: each (file, length) is compared in turn,
    llama.cpp loading that file with prompts of that length, and a summary table ends the run."""
    import shutil
    import sys

    path, _ = tiny_gguf
    other = tmp_path / "other.gguf"
    shutil.copy(path, other)
    monkeypatch.setenv("NANOINFER_LLAMA_CPP_PYTHON", sys.executable)
    doc, out = run_bench(capsys, ["latency", "--model", str(path), "--also", str(other), "--prompt-len", "6,8",
                                  "--decode-len", "3", "--compare", "llama.cpp", "--runs", "1", "--threads", "1",
                                  *PEAKS])
    cs = doc["compares"]
    assert [(c["model"], c["prompt_len"]) for c in cs] == [(str(path), 6), (str(path), 8), (str(other), 6),
                                                          (str(other), 8)]
    assert doc["compare"] == cs[0]
    log = [json.loads(x) for x in stub_llama_cpp.read_text().splitlines()]
    assert [len(e["eval"]) for e in log if "eval" in e] == [6, 6, 8, 8, 6, 6, 8, 8]  # warm-up and timed, per run
    assert "every file against llama.cpp" in out and "other.gguf" in out
    for argv in (["--prompt-len", "4,8"], ["--also", str(other)]):  # both go with --compare only
        assert main(["latency", "--model", str(path), "--decode-len", "2", *argv, *PEAKS]) == 1
        assert "--compare" in capsys.readouterr().err


def test_compare_llama_cpp_errors(stub_llama_cpp, tiny_gguf, make_hf_model, tmp_path, capsys, monkeypatch):
    import sys

    def error(argv: list[str]) -> str:
        assert main(["latency", "--prompt-len", "4", "--decode-len", "2", "--compare", "llama.cpp", *argv,
                     *PEAKS]) == 1
        return capsys.readouterr().err.strip().splitlines()[-1]

    gguf, _ = tiny_gguf
    # neither the flag nor the variable: checked before any model loads
    assert "--llama-cpp-python PYTHON or set NANOINFER_LLAMA_CPP_PYTHON" in error([])
    assert "cannot run it" in error(["--llama-cpp-python", str(tmp_path / "no-such-python")])
    assert "--runs must be >= 1" in error(["--runs", "0", "--llama-cpp-python", sys.executable])
    # an HF folder: llama.cpp cannot run the same file
    _, hf = make_hf_model("llama")
    assert "needs a GGUF model" in error(["--model", str(hf), "--llama-cpp-python", sys.executable])
    # llama.cpp's own failure comes back as one line
    monkeypatch.setenv("STUB_LLAMA_LOG", str(tmp_path / "no-such-dir" / "log"))
    msg = error(["--model", str(gguf), "--llama-cpp-python", sys.executable])
    assert msg.startswith("error: llama.cpp failed") and "No such file" in msg
    # llama_cpp missing from that interpreter
    monkeypatch.delenv("PYTHONPATH")
    monkeypatch.setenv("NANOINFER_LLAMA_CPP_PYTHON", sys.executable)
    msg = error(["--model", str(gguf)])
    assert "llama_cpp is not importable" in msg and "ModuleNotFoundError" in msg


def test_bench_latency_speculative(make_hf_model, capsys):
    """--speculative: the three tasks, with and without speculation alternated, the same greedy
    tokens both ways (the bench refuses to report otherwise), acceptance and speed-up reported;
    a draft model that is the target itself accepts every guess."""
    _, path = make_hf_model("llama")
    doc, out = run_bench(capsys, ["latency", "--model", str(path), "--decode-len", "24", "--runs", "2",
                                  "--speculative", "draft_model", "--speculative-config",
                                  json.dumps({"model": str(path), "num_speculative_tokens": 3, "verify_cost": 0.0})])
    res = doc["speculative"]
    assert set(res["tasks"]) == {"code-edit", "doc-quote", "free"} and res["config"]["method"] == "draft_model"
    for r in res["tasks"].values():
        assert len(r["off_decode_tok_s"]) == len(r["on_decode_tok_s"]) == 2
    full = [r for r in res["tasks"].values() if r["tokens"] == 24]  # an EOS cuts a run of guesses short
    assert full and all(r["acceptance_rate"] == 1.0 and r["tokens_per_step"] > 3 and r["mean_accepted_tokens"] > 2.5
                        for r in full)
    assert "speed-up" in out
    doc, _ = run_bench(capsys, ["latency", "--model", str(path), "--decode-len", "12", "--runs", "1",
                                "--speculative", "ngram"])
    assert doc["speculative"]["config"]["method"] == "ngram"
    assert main(["latency", "--model", str(path), "--speculative", "draft_model"]) == 1
    assert "draft's path" in capsys.readouterr().err


def test_bench_throughput_reports_speculation(make_hf_model, capsys):
    _, path = make_hf_model("llama")
    doc, _ = run_bench(capsys, ["throughput", "--model", str(path), "-n", "2", "--min-input-len", "8",
                                "--max-input-len", "12", "--min-output-len", "8", "--max-output-len", "12",
                                "--speculative-config",
                                json.dumps({"method": "draft_model", "model": str(path), "verify_cost": 0.0})])
    r = doc["results"]["nanoinfer"]
    assert r["spec_proposed_tokens"] > 0 and r["spec_acceptance_rate"] == 1.0 and r["spec_mean_accepted_tokens"] > 1
