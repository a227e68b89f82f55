"""Rejection sampling on its own (engine/spec/rejection.py), on hand-made distributions over a few tokens: the kept
proposals plus the drawn token are distributed as the target's p, whatever the draft's q, checked by chi-square;
greedy keeps exactly the proposals that are the argmax; a seeded request draws the same alone or in a batch."""

import pytest
import torch

from fulcrum.engine.spec.rejection import verify
from fulcrum.layers.sampler import Sampler, SamplingMetadata

# Significance of every chi-square test here. The draws are seeded, so each test passes or fails the same way on
# every run; at 0.1% a correct sampler fails one seed in a thousand.
ALPHA = 1e-3
V = 6


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P(chi2 >= the statistic) for counts against probabilities; cells expected under 5 pooled into one."""
    n = observed.sum()
    expected = expected_probs.double() * n
    small = expected < 5
    obs = torch.cat([observed[~small].double(), observed[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


# the target's logits at two positions (the first proposal's row, then the bonus row) and a draft that disagrees
P_LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 1.5, -1.0, 2.0, 0.5, 0.0]])
Q = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])


def run(n: int, temperature: float, q: torch.Tensor | None, draft_tokens: torch.Tensor, seed: int = 0, gens=None):
    """n requests of one proposal each; returns their output tokens."""
    torch.manual_seed(seed)
    logits = P_LOGITS.repeat(n, 1)
    meta = SamplingMetadata(temperature=torch.full((2 * n,), temperature), all_greedy=temperature == 0)
    drafts = [[int(t)] for t in draft_tokens]
    probs = [q.view(1, -1) if q is not None else None for _ in range(n)]
    return verify(Sampler(), logits, meta, drafts, probs, gens or [None] * n).tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_sampled_draft_keeps_the_target_distribution(temperature):
    n = 20000
    g = torch.Generator().manual_seed(1)
    d = torch.multinomial(Q, n, replacement=True, generator=g)
    out = run(n, temperature, Q, d)
    p = (P_LOGITS / temperature).softmax(-1)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V)
    assert chi_square_p_value(first, p[0]) > ALPHA
    # the bonus token follows an accepted proposal, from the next row's distribution
    bonus = torch.bincount(torch.tensor([o[1] for o in out if len(o) == 2]), minlength=V)
    assert chi_square_p_value(bonus, p[1]) > ALPHA
    # the test can tell: the proposals themselves (q) are far from p
    assert chi_square_p_value(torch.bincount(d, minlength=V), p[0]) < 1e-12
    # and the acceptance is what min(1, p/q) gives: sum_t min(p, q)
    accepted = sum(len(o) == 2 for o in out) / n
    assert abs(accepted - torch.minimum(p[0], Q).sum().item()) < 0.015


def test_a_deterministic_proposal_keeps_the_target_distribution():
    n = 20000
    d = torch.full((n,), 3)  # always token 3: an n-gram's proposal is one token, q one-hot
    out = run(n, 1.0, None, d)
    p = P_LOGITS.softmax(-1)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V)
    assert chi_square_p_value(first, p[0]) > ALPHA
    accepted = sum(len(o) == 2 for o in out) / n
    assert abs(accepted - p[0, 3].item()) < 0.015


def test_greedy_keeps_exactly_the_argmax_proposals():
    out = run(V, 0.0, None, torch.arange(V))
    # row 0's argmax is token 0: only that proposal is kept, and then row 1's argmax (3) follows
    assert out[0] == [0, 3]
    assert all(o == [0] for o in out[1:])


def test_a_seeded_request_draws_the_same_alone_and_in_a_batch():
    d = torch.tensor([1, 2, 3, 4])
    gens = [torch.Generator().manual_seed(7 + i) for i in range(4)]
    batch = run(4, 1.0, Q, d, seed=1, gens=gens)
    after = [g.get_state() for g in gens]
    for i in range(4):
        g = torch.Generator().manual_seed(7 + i)
        alone = run(1, 1.0, Q, d[i : i + 1], seed=99, gens=[g])
        assert alone[0] == batch[i]
        # the generator advanced by one row of noise per output token, alone as in the batch
        assert torch.equal(g.get_state(), after[i])


def test_a_seeded_request_consumes_one_draw_per_output_token():
    """With deterministic proposals a seeded request's tokens are those it samples without speculation: the
    generator is set back to just after the rows it used."""
    g_spec, g_plain = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    out = run(1, 1.0, None, torch.tensor([0]), gens=[g_spec])[0]
    meta = SamplingMetadata(temperature=torch.ones(1), all_greedy=False, generators=[g_plain])
    plain = [Sampler()(P_LOGITS[j : j + 1], meta).token_ids.item() for j in range(len(out))]
    assert out == plain
    assert torch.equal(g_spec.get_state(), g_plain.get_state())
