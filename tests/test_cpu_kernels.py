"""The compiled CPU decode-attention kernel against the plain PyTorch path it replaces."""
from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

import kernel_builds
from nanoinfer import LLM, SamplingParams
from nanoinfer.attention import AttentionParams, CpuPagedAttention, PagedKVCache, PagedMetadata, TorchPagedAttention
from nanoinfer.attention.kv_cache import KVGroup
from nanoinfer.kernels import cpu_kernels

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the kernel cannot be built here", allow_module_level=True)


def test_kernel_builds():
    """With a compiler on the machine the kernel must build and load (no silent fallback)."""
    assert cpu_kernels.library() is not None
    assert cpu_kernels.decode_supported(torch.zeros(1, dtype=torch.float32))
    assert cpu_kernels.decode_supported(torch.zeros(1, dtype=torch.bfloat16))
    assert not cpu_kernels.decode_supported(torch.zeros(1, dtype=torch.float16))


def random_batch(seed: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 ctx: list[int], window: int | None, num_blocks: int = 64, softcap: float | None = None,
                 scale: float | None = None):
    """A cache of random blocks, decode rows at the given context lengths (each with its
    own shuffled blocks), and two extra rows in the flat batch that are not decodes.
    Returns run(kernel) -> attention output of the PyTorch backend or the kernel's, and the rest."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache.allocate([KVGroup(None, (0,))], [num_blocks], block_size, kv_heads, head_dim, dtype,
                                  torch.device("cpu"))
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    width = max(-(-c // block_size) for c in ctx)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(ctx), width, dtype=torch.long)
    used = 0
    for b, c in enumerate(ctx):
        n = -(-c // block_size)
        tables[b, :n] = order[used:used + n]
        used += n
    T = len(ctx) + 2
    rows = torch.arange(1, len(ctx) + 1)  # row 0 and the last row belong to no decode
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    # each decode row's new key goes to its last position; the two others to a spare block's slots
    spare = int(order[used])
    slots = [spare * block_size] + [int(tables[b, (c - 1) // block_size]) * block_size + (c - 1) % block_size
                                    for b, c in enumerate(ctx)] + [spare * block_size + 1]
    ctx_t = torch.tensor(ctx).unsqueeze(1)

    params = [AttentionParams(head_dim ** -0.5 if scale is None else scale, window, softcap)]

    def run(kernel: bool) -> torch.Tensor:
        backend = (CpuPagedAttention if kernel else TorchPagedAttention)(params, cache)
        return backend.forward(0, q, k, v, PagedMetadata([torch.tensor(slots)], [], rows, [tables], ctx_t, max(ctx)))
    return run, (cache, tables, ctx_t, params[0]), q, k, v, rows


CASES = [  # heads, kv_heads, head_dim, block_size, context lengths, window
    (9, 3, 64, 16, [1, 17, 250, 33, 16], None),  # SmolLM2-135M's shapes
    (4, 4, 128, 16, [5, 40, 129], None),  # no grouping, the other specialised head size
    (8, 2, 32, 4, [3, 64, 9, 1], None),  # a head size with no specialisation, small blocks
    (6, 3, 64, 8, [1, 7, 30, 61], 5),  # sliding window, shorter and longer than the context
    (8, 4, 64, 16, [300], None),  # one sequence: its blocks are split over the threads, then merged
    (9, 3, 128, 16, [45, 2], 40),  # two sequences, split too (one into an empty part), with a window
    (9, 3, 64, 16, [5], None),  # one short sequence: more parts than blocks
    (12, 2, 128, 16, [513, 20, 3], None),  # Qwen2.5-1.5B's shapes: six query heads to a kv head (kWideHeads: at once)
    (14, 2, 64, 16, [70, 9], None),  # seven to one (Qwen2.5-0.5B): six, then one
    (8, 2, 128, 16, [300, 2], None),  # four to one
    (4, 1, 256, 16, [40, 3], None),  # Gemma 3's head size
    (32, 32, 96, 16, [40, 3], None),  # Phi-3 mini's: head size 96, no grouping
    (8, 2, 96, 16, [70, 5], None),  # head size 96, four to one
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_pytorch_fp32(case):
    heads, kv_heads, head_dim, block_size, ctx, window = case
    run, _, q, k, v, rows = random_batch(0, torch.float32, heads, kv_heads, head_dim, block_size, ctx, window)
    torch.testing.assert_close(run(True)[rows], run(False)[rows], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]])
def test_kernel_soft_capping_and_scale_match_pytorch(case):
    """Scale and soft-cap are parameters of the layer, not constants of the kernel."""
    heads, kv_heads, head_dim, block_size, ctx, window = case
    scale = 4.0 / head_dim ** 0.5  # scores well past the cap, so capping changes them
    run, _, q, k, v, rows = random_batch(3, torch.float32, heads, kv_heads, head_dim, block_size, ctx, window,
                                         softcap=0.5, scale=scale)
    capped = run(True)
    torch.testing.assert_close(capped[rows], run(False)[rows], atol=2e-6, rtol=1e-5)
    plain, *_ = random_batch(3, torch.float32, heads, kv_heads, head_dim, block_size, ctx, window, scale=scale)
    default, *_ = random_batch(3, torch.float32, heads, kv_heads, head_dim, block_size, ctx, window)
    assert (capped[rows] - plain(True)[rows]).abs().max() > 1e-2
    assert (plain(True)[rows] - default(True)[rows]).abs().max() > 1e-2


@pytest.mark.parametrize("case", CASES[:2] + CASES[3:])
def test_kernel_matches_pytorch_bf16(case):
    """bf16 in and out, fp32 inside (as SDPA's CPU kernel): within bf16 rounding."""
    heads, kv_heads, head_dim, block_size, ctx, window = case
    run, _, q, k, v, rows = random_batch(1, torch.bfloat16, heads, kv_heads, head_dim, block_size, ctx, window)
    ref = run(False).float()
    got = run(True).float()
    torch.testing.assert_close(got[rows], ref[rows], atol=2e-2, rtol=2e-2)
    assert (got[rows] - ref[rows]).abs().mean() < 2e-3


@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], (8, 2, 64, 16, [600, 5, 70], None)]
                         + [c for c in CASES if c[:3] in {(12, 2, 128), (4, 1, 256), (8, 2, 96)}])
def test_a_row_is_the_same_bits_alone_and_in_a_batch(case, q_dtype, kv_dtype):
    """A batch with enough runs for every thread reads each token's keys and values for all kv
    heads in one work item; a row alone splits its heads over the threads: the same bits."""
    heads, kv_heads, head_dim, block_size, ctx, window = case
    _, (cache, tables, ctx_t, params), q, *_ = random_batch(4, kv_dtype, heads, kv_heads, head_dim, block_size,
                                                             ctx, window)
    q = q.to(q_dtype)
    k_cache, v_cache = cache.layer(0)
    rows = torch.arange(len(ctx))
    together = torch.empty_like(q)
    cpu_kernels.paged_decode(q, together, rows, k_cache, v_cache, tables, ctx_t, max(ctx), window, params.scale)
    for b in range(len(ctx)):
        alone = torch.empty_like(q)
        cpu_kernels.paged_decode(q, alone, rows[b:b + 1].contiguous(), k_cache, v_cache, tables[b:b + 1].contiguous(),
                                 ctx_t[b:b + 1].contiguous(), ctx[b], window, params.scale)
        assert torch.equal(alone[b], together[b]), b


CPU_FLAGS = cpu_kernels.first_processor().get("flags", "").split()
ATTENTION_BUILDS = {  # the decode attention's three forms, each built wherever this CPU runs it
    # AVX2 alone (Zen 3): 16 vector registers make a group of query heads take fewer keys and values at a time
    "sixteen registers": ("-mno-avx512f", True),
    # AVX-512 on 256-bit vectors (the build elsewhere than Intel: Zen 4, Zen 5)
    "256-bit with 32 registers": ("-UPA_WIDE_VECTORS", "avx512vl" in CPU_FLAGS),
    # AVX-512 on 512-bit vectors (Intel's build)
    "512-bit": ("-DPA_WIDE_VECTORS", {"avx512bw", "avx512vl"} <= set(CPU_FLAGS)),
}


def attention_form(name: str) -> kernel_builds.Build:
    return kernel_builds.Build(ATTENTION_BUILDS[name][0], "paged_attention.cpp")


def background_builds(names: set[str]) -> list[kernel_builds.Build]:
    """The forms this CPU runs, where the test of the forms is selected (conftest.py starts them)."""
    if "test_each_build_matches_pytorch_and_keeps_rows_apart" not in names:
        return []
    return [attention_form(name) for name, (_, runs_here) in ATTENTION_BUILDS.items() if runs_here]


@pytest.fixture(scope="module", params=list(ATTENTION_BUILDS))
def attention_build(request):
    """paged_attention.cpp built in one of its forms, whatever this CPU's own build is."""
    _, runs_here = ATTENTION_BUILDS[request.param]
    if not runs_here:
        pytest.skip(f"this CPU cannot run the {request.param} build")
    return kernel_builds.built_with(attention_form(request.param), cpu_kernels.declare_attention)


@pytest.mark.parametrize("case", CASES)
def test_each_build_matches_pytorch_and_keeps_rows_apart(case, attention_build, monkeypatch):
    """Groups of six, four and three query heads (and the rest), every head size, as each form
    computes them: close to PyTorch, and a row's bits the same alone and in a batch."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: attention_build)
    test_kernel_matches_pytorch_fp32(case)
    test_kernel_matches_pytorch_bf16(case)
    for q_dtype, kv_dtype in [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                              (torch.bfloat16, torch.bfloat16)]:
        test_a_row_is_the_same_bits_alone_and_in_a_batch(case, q_dtype, kv_dtype)


def test_kernel_leaves_other_rows_alone():
    """Rows that are not decodes (prefill rows, handled elsewhere) are not written."""
    _, (cache, tables, ctx, params), q, k, v, rows = random_batch(2, torch.float32, 9, 3, 64, 16, [20, 3], None)
    out = torch.full_like(q, 7.0)
    cpu_kernels.paged_decode(q, out, rows, *cache.layer(0), tables, ctx, 20, None, params.scale)
    assert torch.all(out[0] == 7.0) and torch.all(out[-1] == 7.0)
    assert not torch.any(out[rows] == 7.0)


def test_engine_same_tokens_with_and_without_kernel(make_hf_model):
    """The whole engine, greedy, batched, with chunked prefill: the kernel changes no token."""
    _, path = make_hf_model("llama", tie=False)
    prompts = [[(7 * i + j) % 300 for j in range(n)] for i, n in enumerate((5, 40, 77, 12))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(path, block_size=4, max_num_batched_tokens=32)
    runner = llm.engine.runner
    assert isinstance(runner.attention, CpuPagedAttention)
    with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    runner.attention = TorchPagedAttention(runner.attention.params, runner.attention.cache)
    without = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert with_kernel == without


@pytest.mark.parametrize("how, message", [
    ("missing", "unavailable"),  # $CXX names no program
    ("failing", "building the CPU kernels failed"),  # a "compiler" that exits 1
    ("disabled", ""),  # NANOINFER_CPU_KERNELS=0: off, silently
    ("unparsable", "building the CPU kernels failed (NANOINFER_CXXFLAGS: no closing quotation)"),
])
def test_without_a_working_compiler_the_pytorch_path_runs(how, message, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NANOINFER_CACHE_DIR", str(tmp_path))  # no kernel built before
    if how == "missing":
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    elif how == "failing":
        monkeypatch.setenv("CXX", shutil.which("false"))
    elif how == "unparsable":
        monkeypatch.setenv("NANOINFER_CXXFLAGS", '"-O2')
    else:
        monkeypatch.setenv("NANOINFER_CPU_KERNELS", "0")
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        assert not cpu_kernels.decode_supported(torch.zeros(1))
        err = capsys.readouterr().err
        assert message in err and (message or not err)
        assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))  # nothing half-built left
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()
    assert cpu_kernels.library() is not None  # the real compiler again


def test_builds_without_a_writable_cache(monkeypatch, tmp_path):
    """A cache directory that cannot be created (a file sits where it should be): the
    kernels are built for this process in a private temporary directory instead."""
    compiler = cpu_kernels.find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("NANOINFER_CACHE_DIR", str(blocker / "cache"))
    # one small source (the rule is build()'s, whatever it builds): seconds, not the whole library's half minute
    path, err = cpu_kernels.build(compiler, cpu_kernels.CSRC, [cpu_kernels.CSRC / "layer_ops.cpp"])
    assert err is None, err
    assert "nanoinfer-kernels-" in str(path.parent) and path.exists()
    assert hasattr(ctypes.CDLL(str(path)), "rms_norm_f32")


def test_loading_the_kernels_keeps_subnormals():
    """Linked with -ffast-math, a shared object sets flush-to-zero for the whole process on
    load: Python then read 1e-310 as 0.0 and refused a subnormal top_p as "top_p=0.0"."""
    import subprocess
    import sys

    code = ("from nanoinfer.kernels import cpu_kernels; import torch; assert cpu_kernels.library() is not None;"
            "x = float('1e-310'); assert x > 0 and repr(x) == '1e-310', repr(x);"
            "assert (torch.tensor([1e-40]) * 1.0).item() > 0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


CPUINFO = ("processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 17\nflags\t\t: {flags}\n\n"
           "processor\t: 1\nvendor_id\t: OtherVendor\nflags\t\t: fpu avx2 avx512f\n")


@pytest.mark.parametrize("vendor, family, flags, want", [
    ("GenuineIntel", "6", "fpu avx2 avx512f",
     ["-DQG_PREFETCH_ONE_GROUP=24576", "-DQG_PREFETCH_NEAR=4096", "-DPA_WIDE_VECTORS", "-DQG_WIDE_TILE_ROWS=8",
      "-DQG_NARROW_TILE_ROWS=3", "-DQG_NARROW_TYPES=28672"]),  # Q4_K (12), Q5_K (13), Q6_K (14)
    ("AuthenticAMD", "25", "fpu avx2", ["-DQG_PREFETCH_LOCALITY=2", "-DQG_NARROW_TILE_ROWS=1"]),  # Zen 3
    ("AuthenticAMD", "25", "fpu avx2 avx512f avx512_vnni",  # Zen 4: Q8_0 (8) and Q4_K (12) left to the hardware
     ["-DQG_PREFETCH_LOCALITY=2", "-DQG_NARROW_TILE_ROWS=1", "-DQG_UNPREFETCHED_TYPES=4352"]),
    ("AuthenticAMD", "26", "fpu avx2 avx512f",  # Zen 5
     ["-DPA_WIDE_VECTORS", "-DQG_NARROW_TILE_ROWS=1", "-DQG_SPREAD_PREFETCH=1", "-DQG_PAIRED_LANES=1",
      "-DQG_SWEPT_WIDE_TILE_ROWS=8", "-DQG_SWEPT_CHUNK_BYTES=262144"]),
    ("HygonGenuine", "24", "fpu avx2", []),
])
def test_vendor_tuning_follows_the_first_processor(vendor, family, flags, want):
    assert cpu_kernels._vendor_flags(CPUINFO.format(vendor=vendor, family=family, flags=flags)) == want


def test_first_processor_reads_one_block():
    cpu = cpu_kernels.first_processor(CPUINFO.format(vendor="AuthenticAMD", family="25", flags="fpu avx2"))
    assert cpu["vendor_id"] == "AuthenticAMD" and cpu["cpu family"] == "25" and cpu["flags"] == "fpu avx2"
    assert cpu_kernels.first_processor("") == {}


def test_no_vendor_tuning_without_a_vendor_line():
    """An Arm /proc/cpuinfo has no vendor_id: the kernels' defaults."""
    assert cpu_kernels._vendor_flags("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n") == []


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(12, 2, 128), (9, 3, 64)])
def test_rows_that_share_blocks_are_the_same_bits_as_alone(heads, kv_heads, head_dim, kv_dtype):
    """Rows that read the same blocks (the rows of one sequence in one step, as speculation checks
    its guesses; sequences that share a prompt's blocks) go to the threads part by part across the
    rows: each row still equals itself alone, bit for bit, and attention over its own keys."""
    g = torch.Generator().manual_seed(5)
    bs, num_blocks = 16, 96
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(kv_dtype)
    order = torch.randperm(num_blocks, generator=g)
    seq = order[:33]  # one sequence of 513 to 516 keys, four rows in one step
    other = order[33:52]  # a sequence of 300 keys
    prompt, tails = order[52:65], order[65:67]  # two sequences sharing 13 blocks of prompt, then their own
    width = 33
    tables = torch.zeros(8, width, dtype=torch.long)
    ctx = [513, 514, 515, 516, 300, 210, 210, 516]
    for b in (0, 1, 2, 3, 7):
        tables[b] = seq
    tables[4, :19] = other
    for b, tail in ((5, tails[0]), (6, tails[1])):
        tables[b, :13] = prompt
        tables[b, 13] = tail
    ctx_t = torch.tensor(ctx).unsqueeze(1)
    q = torch.randn(len(ctx), heads, head_dim, generator=g)
    rows = torch.arange(len(ctx))
    scale = head_dim ** -0.5
    together = torch.empty_like(q)
    cpu_kernels.paged_decode(q, together, rows, k_cache, v_cache, tables, ctx_t, max(ctx), None, scale)
    for b, n in enumerate(ctx):
        alone = torch.empty_like(q)
        cpu_kernels.paged_decode(q, alone, rows[b:b + 1].contiguous(), k_cache, v_cache, tables[b:b + 1].contiguous(),
                                 ctx_t[b:b + 1].contiguous(), n, None, scale)
        assert torch.equal(alone[b], together[b]), b
        keys = k_cache[tables[b]].reshape(-1, kv_heads, head_dim)[:n].float().repeat_interleave(heads // kv_heads, 1)
        values = v_cache[tables[b]].reshape(-1, kv_heads, head_dim)[:n].float().repeat_interleave(heads // kv_heads, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b], keys) * scale, dim=-1)
        torch.testing.assert_close(together[b], torch.einsum("ht,thd->hd", p, values), atol=2e-5, rtol=1e-4)
