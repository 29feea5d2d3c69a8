"""How many guesses a sequence should have checked this step.

Checking k guesses makes the step's forward k rows longer, which on a CPU is far from free
(the block-format GEMV turns compute-bound after a row or two), and a draft model's guesses
cost its own forward each. With a running estimate `a` of the chance that a guess is
accepted given that the one before it was, k guesses yield 1 + a + a^2 + ... + a^k tokens
for a step that costs about 1 + cost_per_guess * k single-token steps; the policy picks
the k (0 to k_max) with the most tokens per unit of cost. No k pays below
a = cost_per_guess, and as a nears 1 the best k grows toward k_max."""
from __future__ import annotations


def worth_checking(accept_rate: float, k_max: int, cost_per_guess: float) -> int:
    """The number of guesses (0..k_max) with the best expected tokens per unit of step cost."""
    if cost_per_guess <= 0.0:
        return k_max
    best_k, best, tokens, p = 0, 1.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        p *= accept_rate
        tokens += p
        rate = tokens / (1.0 + cost_per_guess * k)
        if rate > best:
            best_k, best = k, rate
    return best_k


def updated_accept_rate(rate: float, accepted: int, proposed: int) -> float:
    """The running estimate after a check: of the guesses it reached (the accepted ones, plus
    the first rejected one if any), the share accepted, weighed 0.3 against the past."""
    reached = accepted + (1 if accepted < proposed else 0)
    return 0.7 * rate + 0.3 * (accepted / reached if reached else rate)
