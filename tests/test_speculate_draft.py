"""Speculative decoding with a draft model (treeattn.speculate.accept with a proposal distribution).

- The acceptance rule with a non-one-hot proposal q: the tokens it emits are distributed as the
  target's p (chi-square against the analytic product distribution), and a draft is accepted with
  the analytic probability sum_x min(p(x), q(x)).
"""

from __future__ import annotations

import pytest
import torch

scipy_stats = pytest.importorskip("scipy.stats")

from treeattn.speculate import accept  # noqa: E402


# ----------------------------------------------------------------------- the acceptance rule


def test_acceptance_with_a_proposal_distribution_emits_the_target_distribution():
    """Drafts drawn from q rows, accepted by the rule: the first two emitted tokens are independent
    draws from p's first two rows (the rows do not depend on the tokens here), and the first draft is
    accepted with probability sum_x min(p0(x), q0(x)) = 1 - total variation."""
    g = torch.Generator().manual_seed(1)
    vocab, n = 4, 6000
    probs = torch.softmax(torch.randn(3, vocab, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    proposal = torch.softmax(torch.randn(2, vocab, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    proposal[1, 0] = 0.0  # a token the drafter never proposes, that the target may emit
    proposal[1] /= proposal[1].sum()
    counts = torch.zeros(vocab, vocab)
    first_accepted = 0
    for _ in range(n):
        draft = torch.stack([torch.multinomial(proposal[i], 1, generator=g)[0] for i in range(2)])
        u = torch.rand(3, generator=g, dtype=torch.float64)
        accepted, token = accept(probs, draft, u[:2], float(u[2]), proposal=proposal)
        first_accepted += accepted >= 1
        tokens = draft[:accepted].tolist() + [token]
        second = tokens[1] if len(tokens) >= 2 else int(torch.multinomial(probs[1], 1, generator=g))  # next step's row 0
        counts[tokens[0], second] += 1
    expected = (probs[0][:, None] * probs[1][None, :] * n).flatten()
    assert scipy_stats.chisquare(counts.flatten().numpy(), expected.numpy()).pvalue > 1e-3
    rate = float(torch.minimum(probs[0], proposal[0]).sum())
    assert scipy_stats.binomtest(first_accepted, n, rate).pvalue > 1e-3


def test_one_hot_proposal_is_the_deterministic_rule():
    """proposal=None (prompt lookup, a greedy draft) and an explicit one-hot q give the same outcomes."""
    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(4, 6, generator=g, dtype=torch.float64), dim=-1)
    for _ in range(50):
        draft = torch.randint(0, 6, (3,), generator=g)
        u = torch.rand(4, generator=g, dtype=torch.float64)
        one_hot = torch.nn.functional.one_hot(draft, 6).double()
        assert accept(probs, draft, u[:3], float(u[3])) == accept(probs, draft, u[:3], float(u[3]), proposal=one_hot)


def test_greedy_target_with_a_greedy_draft_is_exact_matching():
    probs = torch.nn.functional.one_hot(torch.tensor([3, 1, 4]), 6).double()
    u = torch.full((2,), 0.999, dtype=torch.float64)
    assert accept(probs, torch.tensor([3, 1]), u, 0.5) == (2, 4)
    assert accept(probs, torch.tensor([3, 2]), u, 0.5) == (1, 1)
    assert accept(probs, torch.tensor([0, 1]), u, 0.5) == (0, 3)
