"""Structured outputs: decoding constrained to a JSON schema, a regex, a list of choices or a
grammar (`SamplingParams(structured_outputs=StructuredOutputsParams(...))`).

`StructuredOutputs` (manager.py) is the engine's one door to it: compile and cache a
constraint, hand each constrained sequence its matcher, mask a step's logits. The grammar
engine behind it is llguidance (llguidance_backend.py), behind the small interface of
backend.py."""
from .backend import Compiled, GrammarBackend, Matcher
from .limits import ConstraintLimits
from .manager import Constraint, StructuredOutputs

__all__ = ["Compiled", "Constraint", "ConstraintLimits", "GrammarBackend", "Matcher", "StructuredOutputs"]
