"""The engine: requests in, one step at a time, deltas out.

    core.py        LLMEngine (add_request / step / abort / release / metrics), EngineConfig
    scheduler.py   who runs each step and how many tokens each: one token budget, preemption
    policy.py      the scheduling policy: who is admitted first, who is preempted (FCFS, priority)
    kv_manager.py  the block pool: allocation, forks, copy-on-write, prefix hashes (the scheduler's only door to it)
    sequence.py    one sample's working state: tokens, text, stop policy, KV placement, speculation
    outputs.py     what a request gives back: RequestOutput, CompletionOutput, StreamDelta, stats
    async_engine.py the engine on its own thread, asyncio queues in front (for the server)
    batch.py       ScheduledBatch: one step as the scheduler decided it
    runner.py      a scheduled batch -> one ForwardBatch -> the model -> logits rows
"""
from .core import EngineConfig, LLMEngine
from .outputs import CompletionOutput, FinishCause, ForwardStat, RequestOutput, RequestStats, StreamDelta

__all__ = ["CompletionOutput", "EngineConfig", "FinishCause", "ForwardStat", "LLMEngine", "RequestOutput",
           "RequestStats", "StreamDelta"]
