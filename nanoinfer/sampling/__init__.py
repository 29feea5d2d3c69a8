"""Sampling: the parameters a request carries and the batched sampler (equal, row by row, to
the per-row definition in sampler.py). Structured-output masks and speculative verification
plug in beside the sampler."""
from .batch_sampler import Sampled, SampleRow, sample_rows
from .params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, POOLING, SamplingParams, StructuredOutputsParams
from .sampler import Logprob, RowSampler, scale

__all__ = ["MAX_STOP_LENGTH", "MAX_STOP_STRINGS", "POOLING", "Logprob", "RowSampler", "SampleRow", "Sampled", "SamplingParams",
           "StructuredOutputsParams", "sample_rows", "scale"]
