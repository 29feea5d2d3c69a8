"""How many guesses a sequence should have checked this step.

Checking k guesses makes the step's forward k rows longer. Where a step is bound by reading
the weights (float weights on a CPU, a GPU) that is nearly free; where the kernels are
compute-bound after a row or two (block-format weights on a small CPU) it is not, and a
draft model's guesses cost its own forward each. So the cost is measured: the engine keeps
the running time of its decode steps by their number of rows (`StepTimes`), and a step with
k guesses costs time(rows + k) / time(rows) of one without; until both are measured,
1 + verify_cost * k stands in.

With a running estimate `a` of the chance that a guess is accepted given that the one before
it was, k guesses yield 1 + a + a^2 + ... + a^k tokens; the policy picks the k (0 to k_max)
with the most tokens per unit of cost."""
from __future__ import annotations

from dataclasses import dataclass, field


def worth_checking(accept_rate: float, step_costs: list[float]) -> int:
    """The number of guesses with the best expected tokens per unit of step cost, where
    step_costs[k] is what a step with k guesses costs (step_costs[0] = 1: none)."""
    best_k, best, tokens, p = 0, 1.0, 1.0, 1.0
    for k in range(1, len(step_costs)):
        p *= accept_rate
        tokens += p
        rate = tokens / step_costs[k]
        if rate > best:
            best_k, best = k, rate
    return best_k


def updated_accept_rate(rate: float, accepted: int, proposed: int) -> float:
    """The running estimate after a check: of the guesses it reached (the accepted ones, plus
    the first rejected one if any), the share accepted, weighed 0.3 against the past."""
    reached = accepted + (1 if accepted < proposed else 0)
    return 0.7 * rate + 0.3 * (accepted / reached if reached else rate)


@dataclass
class StepTimes:
    """The running mean wall time of a decode-only step, by the number of rows its forward had."""
    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def step_costs(self, rows: int, k_max: int, prior: float, guess_cost: float) -> list[float]:
        """What a step of `rows` decode rows costs with 0..k_max guesses added, relative to
        none: measured where both times are known, else 1 + prior * k; each guess also
        costs `guess_cost` to make (a draft model's forward)."""
        base = self.seconds.get(rows)
        costs = [1.0]
        for k in range(1, k_max + 1):
            more = self.seconds.get(rows + k)
            verify = max(1.0, more / base) if base and more else 1.0 + prior * k
            costs.append(verify + guess_cost * k)
        return costs
