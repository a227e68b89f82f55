"""SLOs, quality bounds and the template a `--serve-cmd` is filled from."""

from __future__ import annotations

import pytest

from fulcrum.bench.client import RequestResult
from fulcrum.tune.space import Config, render, template_knobs
from fulcrum.tune.target import EarlyBreak, parse_quality, parse_slo, quality_verdict, slo_misses


def test_slo_parsing():
    bounds = parse_slo("ttft_p90=500ms, tpot_p99=0.05s,e2e=3s")
    assert [(b.metric, b.stat, b.seconds) for b in bounds] == [("ttft", "p90", 0.5), ("tpot", "p99", 0.05),
                                                               ("e2e", "p90", 3.0)]  # fmt: skip
    for bad in ("ttft_p42=1s", "latency=1s", "ttft_p90=fast", "ttft_p90=0ms", "", "ttft=1s,ttft_p90=2s"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_quality_bounds():
    bounds = parse_quality("kl=0.01,top1=0.95")
    assert quality_verdict({"kl_mean": 0.001, "top1_agreement": 0.97}, bounds) is None
    assert quality_verdict({"kl_mean": 0.02, "top1_agreement": 0.9}, bounds) == "kl 0.02 > 0.01; top1 0.9 < 0.95"
    with pytest.raises(ValueError):
        parse_quality("bleu=3")


def test_a_figure_eval_did_not_give_is_a_miss():
    assert quality_verdict({"kl_mean": None}, {"kl": 0.01}) == "kl missing from fulcrum eval's figures"


@pytest.mark.parametrize("p", [50, 90, 95, 99])
@pytest.mark.parametrize("n", [5, 10, 17, 40])
def test_a_point_is_given_up_exactly_when_numpys_percentile_can_no_longer_meet_the_bound(p, n):
    import numpy as np

    early = EarlyBreak(parse_slo(f"ttft_p{p}=500ms"), planned=n)
    misses = 0
    while not early.add(result(0.9)):
        misses += 1
    # with `misses` slow requests the percentile can still be met (when they are only just slow); with one more
    # it cannot, however little slow they are
    just = 0.5 + 1e-6
    ok = [0.1] * (n - misses) + [just] * misses
    bad = [0.1] * (n - misses - 1) + [just] * (misses + 1)
    assert np.percentile(ok, p) <= 0.5 < np.percentile(bad, p)


def test_slo_misses_name_the_broken_bound():
    s = {"ttft_ms": {"p90": 612.0}, "tpot_ms": {"p90": 20.0}, "e2e_ms": {"p90": 900.0}, "itl_ms": {"p90": None}}
    assert slo_misses(s, parse_slo("ttft_p90=500ms,tpot_p90=50ms,itl_p90=10ms")) == ["ttft_p90 612ms > 500ms"]


def result(ttft: float, ok: bool = True) -> RequestResult:
    return RequestResult(0, 0, ok=ok, ttft=ttft, e2e=ttft + 1, output_tokens=11)


def test_a_point_is_given_up_once_its_percentile_is_lost():
    early = EarlyBreak(parse_slo("ttft_p90=500ms"), planned=20)  # p90 of 20: two requests may miss
    assert not early.add(result(0.9)) and not early.add(result(0.9))
    assert not early.add(result(0.1))
    assert early.add(result(0.9)) and "3 requests over 500ms" in early.reason


def test_a_failed_request_counts_as_a_miss():
    early = EarlyBreak(parse_slo("ttft_p90=500ms"), planned=10)
    assert not early.add(result(0.1, ok=False))
    assert early.add(result(0.1, ok=False))


def test_config_renders_as_serve_flags_and_file_flags():
    c = Config().with_(max_num_seqs=16, no_prefix_caching=True, speculative_config={"method": "ngram"},
                       kv_cache_memory=0.5)  # fmt: skip
    assert c.serve_args() == ["--max-num-seqs", "16", "--kv-cache-memory", "0.5", "--no-prefix-caching",
                              "--speculative-config", '{"method":"ngram"}']  # fmt: skip
    assert c.file_flags()["max-num-seqs"] == 16 and c.file_flags()["no-prefix-caching"] is True
    assert Config().with_(max_num_seqs=128).changes == {}  # the default is no change


def test_template_fills_values_prefixes_and_leaves_unset_knobs_out():
    t = "serve --model {model} --port {port} --max-num-seqs {max_num_seqs} {quantization:--quantization } {no_prefix_caching:--no-enable-prefix-caching}"
    assert template_knobs(t) == {"max_num_seqs", "quantization", "no_prefix_caching"}
    assert render(t, Config(), 9000, "/m").split() == ["serve", "--model", "/m", "--port", "9000", "--max-num-seqs",
                                                       "128"]  # fmt: skip
    c = Config().with_(max_num_seqs=8, quantization="fp8", no_prefix_caching=True)
    assert render(t, c, 9000, "/m").split()[5:] == ["--max-num-seqs", "8", "--quantization", "fp8",
                                                    "--no-enable-prefix-caching"]  # fmt: skip
    with pytest.raises(ValueError, match="needs a {port}"):
        template_knobs("serve {max_num_seqs}")
    with pytest.raises(ValueError, match="unknown placeholder"):
        template_knobs("serve {port} {max_seqs}")
    with pytest.raises(ValueError, match="is a switch"):  # a bare switch would render nothing, on or off
        template_knobs("serve {port} {no_prefix_caching}")
