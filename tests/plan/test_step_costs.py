"""The step-cost model: a fit recovers the costs that made the steps, a step's cost rises with its work, a cost file
round-trips, and a malformed one is a one-line error."""

import json

import pytest

from fulcrum.plan.step_costs import (
    LINEAR_FEATURES,
    StepCosts,
    StepShape,
    decode_seconds,
    errors,
    fit,
    prefill_seconds,
)

TRUE = StepCosts(
    knots=(1, 4, 16, 64, 256, 1024),
    knot_seconds=[1.0e-3, 1.5e-3, 3.0e-3, 8.0e-3, 30e-3, 120e-3],
    coef={"samples": 20e-6, "decode_kv": 0.5e-6, "prefill_rows": 0.4e-3, "prefill_attn": 2e-9},
)


def synthetic_steps() -> list[tuple[StepShape, float]]:
    """Decodes of 1-64 rows over several contexts, prefills of 4-1024 tokens after 0-512 cached, and mixes of the
    two, each costed by TRUE."""
    shapes = []
    for rows in (1, 2, 3, 4, 8, 12, 16, 32, 48, 64):
        for context in (16, 200, 900):
            s = StepShape()
            for _ in range(rows):
                s.add(1, context, True)
            shapes.append(s)
    for tokens in (4, 10, 16, 40, 64, 100, 256, 600, 1024):
        for cached in (0, 128, 512):
            s = StepShape()
            s.add(tokens, cached, cached % 256 == 0)
            shapes.append(s)
            mixed = StepShape()
            for _ in range(1 + cached // 64):
                mixed.add(1, 300, True)
            mixed.add(tokens, cached, False)
            shapes.append(mixed)
    return [(s, TRUE.step_seconds(s)) for s in shapes]


def test_a_fit_recovers_the_costs_that_made_the_steps():
    costs = fit(synthetic_steps(), knots=TRUE.knots)
    assert costs.knot_seconds == pytest.approx(TRUE.knot_seconds, rel=1e-6, abs=1e-9)
    for name in LINEAR_FEATURES:
        assert costs.coef[name] == pytest.approx(TRUE.coef[name], rel=1e-5, abs=1e-12)
    assert errors(costs, synthetic_steps())["max"] < 1e-6


def test_knots_no_step_reaches_are_dropped_not_left_at_zero():
    # steps of 1, 4 and 16 tokens only: the default knots at 2, 8 and beyond 16 have nothing to fit them
    steps = [(s, t) for s, t in synthetic_steps() if s.tokens in (1, 4, 16)]
    costs = fit(steps)
    assert costs.knots == (1, 4, 16)
    assert decode_seconds(costs, 1, 100) < decode_seconds(costs, 2, 100) < decode_seconds(costs, 4, 100)
    assert decode_seconds(costs, 64, 100) > decode_seconds(costs, 16, 100)  # beyond: along the last segment


def test_a_step_costs_more_with_more_rows_context_and_prompt():
    assert decode_seconds(TRUE, 8, 100) > decode_seconds(TRUE, 1, 100)
    assert decode_seconds(TRUE, 8, 1000) > decode_seconds(TRUE, 8, 100)
    assert prefill_seconds(TRUE, 1024, 2048) > prefill_seconds(TRUE, 128, 2048)


def test_a_long_prompt_is_costed_chunk_by_chunk():
    whole = prefill_seconds(TRUE, 1000, 2048)
    first, second = StepShape(), StepShape()
    first.add(512, 0, False)
    second.add(488, 512, True)
    assert prefill_seconds(TRUE, 1000, 512) == pytest.approx(TRUE.step_seconds(first) + TRUE.step_seconds(second))
    assert prefill_seconds(TRUE, 1000, 512) > whole  # a step's fixed cost twice


def test_a_cost_file_round_trips(tmp_path):
    path = TRUE.save(tmp_path / "costs.json")
    again = StepCosts.load(path)
    assert again.knots == TRUE.knots and again.knot_seconds == TRUE.knot_seconds and again.coef == TRUE.coef
    assert json.loads(path.read_text())["format"] == "fulcrum-step-costs/1"


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{not json", "not JSON"),
        ('{"format": "something-else/1"}', "not a fulcrum step-cost file"),
        ('{"format": "fulcrum-step-costs/1", "knots": [1, 2]}', "malformed step-cost file"),
        (
            '{"format": "fulcrum-step-costs/1", "knots": [4, 1], "knot_seconds": [1, 2], "coef": '
            '{"samples": 0, "decode_kv": 0, "prefill_rows": 0, "prefill_attn": 0}}',
            "knots must rise",
        ),
    ],
)
def test_a_malformed_cost_file_is_a_one_line_error(tmp_path, content, says):
    path = tmp_path / "costs.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=says) as e:
        StepCosts.load(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_a_missing_cost_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ValueError, match="fulcrum sim calibrate"):
        StepCosts.load(tmp_path / "none.json")
