"""Evaluations of a model's quality: HumanEval pass@k (humaneval.py), completions from the
engine or any OpenAI-compatible server (generation.py), the `nanoinfer eval` command (cli.py)."""
