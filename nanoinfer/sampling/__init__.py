"""Sampling: the parameters a request carries and the sampler each row runs.
(Structured-output masks and speculative verification plug in beside the sampler.)"""
from .params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams, StructuredOutputsParams
from .sampler import Logprob, RowSampler, scale

__all__ = ["MAX_STOP_LENGTH", "MAX_STOP_STRINGS", "Logprob", "RowSampler", "SamplingParams", "StructuredOutputsParams", "scale"]
