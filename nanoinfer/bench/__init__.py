"""Benchmarks: `nanoinfer bench latency | throughput | loop | serve`.

roofline.py  what a forward must move and compute (pure accounting on config + tensors)
peaks.py     peak FLOP/s and bandwidth: GPU table, measured and cached CPU probe
latency.py   prefill and decode per batch size: TTFT, TPOT, tok/s, MBU, MFU
throughput.py many requests at once (nano-vllm's protocol), optionally against transformers
loop.py      per-forward time of the uncached reference loop against the engine's cached loop
serve.py     load generator for any OpenAI-compatible server: TTFT, TPOT, ITL, E2E, goodput
"""
