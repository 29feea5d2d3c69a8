"""Tools the model can call while generating (calculator) and a sandbox for running code."""
from .calculator import CALCULATOR, TOOLS, Tool, use_calculator
from .sandbox import ExecutionResult, execute_code

__all__ = ["Tool", "CALCULATOR", "TOOLS", "use_calculator", "ExecutionResult", "execute_code"]
