"""--threads: the physical cores by default, an equal share for each replica or tensor-parallel
rank, and one setting for torch and the compiled kernels."""
from __future__ import annotations

import os

import torch

from nanoinfer import threads
from nanoinfer.cli import main


def test_physical_cores_and_shares():
    cores = threads.physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert threads.share(8, 2) == 4 and threads.share(3, 2) == 1 and threads.share(1, 4) == 1
    assert threads.share(None, 1) == cores


def test_use_sets_torch_and_the_kernels_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    try:
        assert threads.use(1) == 1 and torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"  # threads started later (the engine's) begin there
        assert threads.use(None) == threads.physical_cores() == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_every_model_command_takes_threads(capsys):
    """generate, chat, serve, perplexity, eval and the model benches take --threads (bench keeps its own,
    with the same meaning)."""
    for command in (["generate"], ["chat"], ["serve"], ["perplexity"], ["eval", "humaneval"], ["bench", "latency"],
                    ["bench", "throughput"], ["bench", "loop"]):
        try:
            main([*command, "--help"])
        except SystemExit:
            pass
        assert "--threads" in capsys.readouterr().out, command
