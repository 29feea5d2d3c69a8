"""Tool use inside generation: a small state machine per sequence (nanochat's).

    sampled <|python_start|>  ->  start collecting
    sampled token             ->  collect it
    sampled <|python_end|>    ->  run the tool on the collected text; if it answers, force
                                  <|output_start|> result <|output_end|> into the output

Forced tokens carry mask 0 (the model did not choose them; RL keeps them out of the loss).
They are appended to the sequence at once, so the next step computes them as one chunk,
in a single forward, rather than one token per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .calculator import TOOLS, Tool


@dataclass(frozen=True)
class BoundTool:
    """A tool with its marker tokens resolved in one tokenizer's vocabulary."""

    tool: Tool
    start_id: int
    end_id: int
    output_start_id: int
    output_end_id: int

    @classmethod
    def bind(cls, tool: Tool, tokenizer) -> BoundTool | None:
        ids = [tokenizer.token_to_id(t) for t in (tool.start_token, tool.end_token, tool.output_start, tool.output_end)]
        return None if None in ids else cls(tool, *ids)


def bind_tools(tokenizer, tools: list[Tool] | None = None) -> list[BoundTool]:
    """The tools whose marker tokens this vocabulary has (none for most models)."""
    bound = (BoundTool.bind(t, tokenizer) for t in (tools if tools is not None else TOOLS.values()))
    return [b for b in bound if b is not None]


@dataclass
class ToolUseState:
    tools: list[BoundTool]
    tokenizer: object
    active: BoundTool | None = None
    collected: list[int] = field(default_factory=list)

    def after_token(self, token: int) -> list[int]:
        """Advance on a sampled token; return the tokens to force next (often none)."""
        if self.active is None:
            self.active = next((t for t in self.tools if t.start_id == token), None)
            self.collected = []
            return []
        if token != self.active.end_id:
            self.collected.append(token)
            return []
        tool, self.active = self.active, None
        result = tool.tool.fn(self.tokenizer.decode(self.collected))
        if result is None:
            return []
        return [tool.output_start_id, *self.tokenizer.encode(result, add_special_tokens=False), tool.output_end_id]
