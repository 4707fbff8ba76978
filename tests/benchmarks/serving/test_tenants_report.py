"""bench_tenants' arithmetic on made-up requests (no server): a prompt's first request is left
out, the ratio is to `alone` under the same fraction, the verdict reads the default share's
row, and bad options are refused by name."""

from __future__ import annotations

import pytest

from benchmarks.serving import bench_tenants as bt


def _req(case: str, fraction: float, cached: int, first: bool = False) -> bt.Request:
    return bt.Request(case, fraction, "quiet-1", 0, 257, cached, 10.0, first)


def _results(noisy_default: int, noisy_off: int) -> bt.Results:
    res = bt.Results()
    for case, fraction, cached in (("alone", 0.5, 256), ("noisy", 0.5, noisy_default),
                                   ("alone", 1.0, 256), ("noisy", 1.0, noisy_off)):
        res.requests += [_req(case, fraction, 0, first=True),  # cold: left out
                         _req(case, fraction, cached), _req(case, fraction, cached)]
    res.metrics["noisy-0.5"] = {'kvtier_evictions_total{tier="cpu"}': 40.0,
                                'kvtier_share_evictions_total{tier="cpu"}': 38.0}
    return res


def test_ratios_to_alone_under_the_same_fraction() -> None:
    rows = bt.summarize(_results(noisy_default=240, noisy_off=0))
    by = {(r["case"], r["tenant_max_fraction"]): r for r in rows}
    assert by[("alone", 0.5)]["mean_hit_rate"] == 1.0  # the cold first request left out
    assert by[("noisy", 0.5)]["over_alone"] == pytest.approx(240 / 256)
    assert by[("noisy", 1.0)]["over_alone"] == 0.0
    assert by[("noisy", 0.5)]["share_evictions"] == 38.0
    assert by[("alone", 1.0)]["evictions"] is None  # not scraped
    assert bt.verdict(rows) is True


def test_the_verdict_fails_below_nine_tenths() -> None:
    assert bt.verdict(bt.summarize(_results(noisy_default=200, noisy_off=256))) is False
    assert bt.verdict([]) is None


@pytest.mark.parametrize("argv, word", [
    (["--rounds", "2", "--quiet-prompts", "2"], "--rounds must exceed"),
    (["--noise", "-1"], "--noise"),
    (["--prompt-len", "64", "--chunk-size", "64"], "--prompt-len"),
])
def test_bad_options_are_refused_by_name(argv: list[str], word: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        bt.parse_args(argv)
    assert stop.value.code == 2 and word in capsys.readouterr().err
