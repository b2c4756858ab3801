"""Saving, length tables (dilaserve/sim/traces.py) and synthetic traces (sim/synthetic.py), on
hand-checkable or seeded cases. Statistical bounds are loose (several standard deviations) and
seeds are fixed, so these tests neither flake nor pass by luck."""

import numpy as np
import pytest

from dilaserve.sim.spec import SimulationSpec
from dilaserve.sim.synthetic import (
    DEFAULT_HOURLY_PROFILE,
    diurnal_arrivals,
    diurnal_rates,
    gamma_arrivals,
    load_hourly_profile,
    paper_trace,
    parse_fixed,
    parse_poisson,
    poisson_arrivals,
    synthesize_trace,
)
from dilaserve.sim.traces import (
    SHAREGPT_FIRST_TURNS,
    SHAREGPT_LENGTHS,
    Trace,
    filter_lengths,
    length_stats,
    load_lengths,
    load_trace,
    save_trace,
)
from dilaserve.sim.workload import make_trace


def write(path, text):
    path.write_text(text)
    return path


def rng(seed=0):
    return np.random.default_rng(seed)


# -- save_trace -----------------------------------------------------------------------------


def awkward_trace(slo):
    """Arrival times whose decimal forms are long (1/3, uniform draws), to catch rounding."""
    times = np.sort(np.concatenate([[0.0, 1 / 3, 2 / 3], rng().uniform(0, 1e4, 50)]))
    n = len(times)
    return Trace(
        times,
        np.arange(n, dtype=np.int64) * 7,
        np.arange(n, dtype=np.int64) * 32 + 32,
        None if not slo else rng(1).uniform(0.1, 10.0, n),
        "test",
    )


@pytest.mark.parametrize("slo", [False, True])
def test_save_then_load_gives_back_the_same_arrays(tmp_path, slo):
    trace = awkward_trace(slo)
    back = load_trace(save_trace(tmp_path / "t.csv", trace))
    assert np.array_equal(back.arrival, trace.arrival)  # exact: no digits lost
    assert np.array_equal(back.prompt_tokens, trace.prompt_tokens)
    assert np.array_equal(back.output_tokens, trace.output_tokens)
    if slo:
        assert np.array_equal(back.slo, trace.slo)
    else:
        assert back.slo is None
    header = (tmp_path / "t.csv").read_text().splitlines()[0]
    assert header == "arrival_time,prompt_tokens,output_tokens" + (",slo" if slo else "")


def test_save_refuses_traces_it_could_not_read_back(tmp_path):
    empty = Trace(np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64))
    with pytest.raises(ValueError, match="no requests"):
        save_trace(tmp_path / "e.csv", empty)
    ragged = Trace(np.array([0.0, 1.0]), np.array([1, 2]), np.array([32]))
    with pytest.raises(ValueError, match="2 arrival times but 1 output_tokens"):
        save_trace(tmp_path / "r.csv", ragged)


# -- lengths ----------------------------------------------------------------------------------


def test_lengths_load_by_column_name(tmp_path):
    table = write(
        tmp_path / "l.csv",
        "pd_ratio,num_decode_tokens,num_total_tokens,num_prefill_tokens\n"
        "0.5,20,30,10\n2.0,5,15,10\n",
    )
    prompt, output = load_lengths(table)
    assert prompt.tolist() == [10, 10] and output.tolist() == [20, 5]
    assert prompt.dtype == np.int64
    own = write(tmp_path / "o.csv", "arrival_time,prompt_tokens,output_tokens\n0,3,4\n")
    assert [a.tolist() for a in load_lengths(own)] == [[3], [4]]


def test_bad_length_tables_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        load_lengths(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="num_decode_tokens"):
        load_lengths(write(tmp_path / "a.csv", "num_prefill_tokens,pd_ratio\n10,1\n"))
    with pytest.raises(ValueError, match="line 3"):
        load_lengths(write(tmp_path / "b.csv", "num_prefill_tokens,num_decode_tokens\n1,2\n3,x\n"))
    with pytest.raises(ValueError, match="no rows"):
        load_lengths(write(tmp_path / "c.csv", "num_prefill_tokens,num_decode_tokens\n"))


def test_the_sharegpt_table_loads():
    if not SHAREGPT_LENGTHS.exists():
        pytest.skip(f"{SHAREGPT_LENGTHS} absent (CI clone without ../shared)")
    prompt, output = load_lengths(SHAREGPT_LENGTHS)
    assert len(prompt) == len(output) == 30_731
    assert output.max() == 1024  # the table caps outputs at 1,024 tokens


def test_filter_rounds_outputs_up_to_blocks_and_drops_what_no_longer_fits():
    prompt = [100, 4000, 4010, 10, 4090, 5000, 4064]
    output = [0, 96, 80, 33, 1, 0, 0]
    kept_prompt, kept_output = filter_lengths(prompt, output, max_total=4096, block_len=32)
    # (100, 0): an empty output still takes one block -> 32.
    # (4000, 96): exactly 4096 -> kept.  (4010, 80): 4090 fits, but 80 -> 96 makes 4106 -> out.
    # (10, 33) -> 64.  (4090, 1): 1 -> 32 makes 4122 -> out.  (5000, 0): too long -> out.
    # (4064, 0): 0 -> 32 makes exactly 4096 -> kept.
    assert kept_prompt.tolist() == [100, 4000, 10, 4064]
    assert kept_output.tolist() == [32, 96, 64, 32]
    assert filter_lengths([5], [9], max_total=100, block_len=8)[1].tolist() == [16]


def test_filter_rejects_bad_input():
    with pytest.raises(ValueError, match="equally long"):
        filter_lengths([1, 2], [3])
    with pytest.raises(ValueError, match="negative"):
        filter_lengths([1], [-3])
    with pytest.raises(ValueError, match="integers"):
        filter_lengths([1.5], [3])
    with pytest.raises(ValueError, match="no .prompt, output. length pairs"):
        filter_lengths([], [])
    with pytest.raises(ValueError, match="block_len"):
        filter_lengths([1], [3], block_len=0)


# -- arrivals ---------------------------------------------------------------------------------


def test_poisson_arrivals_count_and_gaps():
    times = poisson_arrivals(10.0, 1000.0, rng())
    # 10,000 expected, standard deviation 100.
    assert 9_500 < len(times) < 10_500
    assert np.all(np.diff(times) >= 0) and times[0] >= 0 and times[-1] < 1000.0
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential gaps
    assert np.array_equal(times, poisson_arrivals(10.0, 1000.0, rng()))
    assert not np.array_equal(times[:100], poisson_arrivals(10.0, 1000.0, rng(1))[:100])
    assert len(poisson_arrivals(0.0, 100.0, rng())) == 0


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_arrivals_have_the_asked_mean_and_variation(cv):
    times = gamma_arrivals(5.0, cv, 2000.0, rng())
    # 10,000 expected; the count's standard deviation is about cv x 100.
    assert abs(len(times) - 10_000) < 5 * cv * 100
    assert np.all(np.diff(times) >= 0) and times[0] > 0 and times[-1] < 2000.0
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.2, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert np.array_equal(times, gamma_arrivals(5.0, cv, 2000.0, rng()))


def test_arrival_generators_reject_bad_parameters():
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(-1.0, 10.0, rng())
    with pytest.raises(ValueError, match="duration"):
        poisson_arrivals(1.0, -10.0, rng())
    with pytest.raises(ValueError, match="rate"):
        gamma_arrivals(-1.0, 1.0, 10.0, rng())
    for cv in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="cv"):
            gamma_arrivals(1.0, cv, 10.0, rng())


# -- diurnal ----------------------------------------------------------------------------------


def test_default_profile_is_a_day_low_at_night_high_in_the_evening():
    profile = np.asarray(DEFAULT_HOURLY_PROFILE)
    assert len(profile) == 24 and profile.max() == 1.0
    assert int(np.argmin(profile)) in range(2, 7)
    assert int(np.argmax(profile)) in range(13, 22)
    # Mean/peak near the 63,736 / (7,200 s x 20 RPS) = 0.443 the paper's numbers imply.
    assert profile.mean() == pytest.approx(0.443, abs=0.01)


def test_diurnal_compresses_a_day_and_peaks_at_peak_rps():
    times = diurnal_arrivals(DEFAULT_HOURLY_PROFILE, 5.0, 20.0, rng())
    assert np.all(np.diff(times) >= 0)
    assert times[0] >= 0 and 7_190 < times[-1] < 24 * 5 * 60  # 2 hours
    counts = np.histogram(times, bins=24, range=(0, 7_200))[0]
    # busiest interval: 6,000 expected at 20 RPS x 300 s (standard deviation 77)
    assert counts.max() / 300 == pytest.approx(20.0, rel=0.05)
    assert int(np.argmax(counts)) == int(np.argmax(DEFAULT_HOURLY_PROFILE))
    assert counts.max() > 10 * counts.min()
    assert np.corrcoef(counts, DEFAULT_HOURLY_PROFILE)[0, 1] > 0.99
    # 64,140 expected (0.4454 x 20 RPS x 7,200 s); the paper's trace has 63,736.
    assert 62_000 < len(times) < 66_500
    assert np.array_equal(times, diurnal_arrivals(DEFAULT_HOURLY_PROFILE, 5.0, 20.0, rng()))


def test_diurnal_takes_any_shape_and_interval():
    shape = [1.0] * 12 + [3.0] * 12  # counts work as well as rates: only the shape matters
    assert diurnal_rates(shape, 6.0).tolist() == [2.0] * 12 + [6.0] * 12
    times = diurnal_arrivals(shape, minutes_per_hour=1.0, peak_rps=6.0, rng=rng())
    assert times[-1] < 24 * 60
    first, second = np.sum(times < 720), np.sum(times >= 720)
    assert 1_300 < first < 1_580 and 4_100 < second < 4_540  # 1,440 and 4,320 expected


def test_hourly_profile_from_csv(tmp_path):
    rows = [f"{h},{100 + h}" for h in range(24)]
    shuffled = rows[12:] + rows[:12]
    path = write(tmp_path / "p.csv", "hour,count\n" + "\n".join(shuffled) + "\n")
    assert load_hourly_profile(path).tolist() == [100.0 + h for h in range(24)]
    plain = write(tmp_path / "q.csv", "rate\n" + "\n".join(str(h + 1) for h in range(24)))
    assert load_hourly_profile(plain)[-1] == 24.0
    assert diurnal_rates(plain, 48.0)[0] == pytest.approx(2.0)  # a path works directly
    times = diurnal_arrivals(path, 0.1, 5.0, rng())
    assert len(times) == len(diurnal_arrivals(path, 0.1, 5.0, rng()))


def test_bad_hourly_profiles_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        diurnal_arrivals([], 5.0, 20.0, rng())
    with pytest.raises(ValueError, match="24 values.*got 23"):
        diurnal_arrivals([1.0] * 23, 5.0, 20.0, rng())
    with pytest.raises(ValueError, match="finite and >= 0"):
        diurnal_arrivals([1.0] * 23 + [-1.0], 5.0, 20.0, rng())
    with pytest.raises(ValueError, match="every hourly rate is 0"):
        diurnal_arrivals([0.0] * 24, 5.0, 20.0, rng())
    with pytest.raises(ValueError, match="peak_rps"):
        diurnal_arrivals(DEFAULT_HOURLY_PROFILE, 5.0, -1.0, rng())
    with pytest.raises(ValueError, match="minutes_per_hour"):
        diurnal_arrivals(DEFAULT_HOURLY_PROFILE, 0.0, 20.0, rng())
    with pytest.raises(TypeError, match="rng"):
        diurnal_arrivals(DEFAULT_HOURLY_PROFILE, 5.0, 20.0)
    with pytest.raises(ValueError, match="no `rate` or `count`"):
        load_hourly_profile(write(tmp_path / "a.csv", "hour,requests\n0,1\n"))
    with pytest.raises(ValueError, match="24 values.*got 2"):
        load_hourly_profile(write(tmp_path / "b.csv", "rate\n1\n2\n"))
    with pytest.raises(ValueError, match="not 0..1 once"):
        load_hourly_profile(write(tmp_path / "c.csv", "hour,rate\n1,1\n1,2\n"))
    with pytest.raises(FileNotFoundError):
        load_hourly_profile(tmp_path / "missing.csv")


# -- synthetic traces -------------------------------------------------------------------------


def test_synthesize_samples_only_given_pairs():
    prompt, output = np.array([1, 2, 3]), np.array([32, 64, 96])
    arrivals = np.array([5.0, 1.0, 3.0] * 100)
    trace = synthesize_trace(arrivals, prompt, output, rng(), slo=2.5)
    pairs = set(zip(trace.prompt_tokens.tolist(), trace.output_tokens.tolist()))
    assert pairs == {(1, 32), (2, 64), (3, 96)}  # never a mixed pair, and all three drawn
    assert trace.arrival[0] == 0.0 and np.all(np.diff(trace.arrival) >= 0)
    assert trace.duration == 4.0 and trace.slo.tolist() == [2.5] * 300
    again = synthesize_trace(arrivals, prompt, output, rng(), slo=2.5)
    assert np.array_equal(again.prompt_tokens, trace.prompt_tokens)


def test_synthesize_keeps_per_arrival_slos_with_their_arrivals():
    trace = synthesize_trace([3.0, 1.0, 2.0], [10], [32], rng(), slo=[30.0, 10.0, 20.0])
    assert trace.arrival.tolist() == [0.0, 1.0, 2.0]
    assert trace.slo.tolist() == [10.0, 20.0, 30.0]


def test_synthesize_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        synthesize_trace([], [1], [32], rng())
    with pytest.raises(ValueError, match="finite"):
        synthesize_trace([0.0, float("nan")], [1], [32], rng())
    with pytest.raises(ValueError, match="equally long"):
        synthesize_trace([0.0], [1, 2], [32], rng())
    with pytest.raises(ValueError, match="one per arrival"):
        synthesize_trace([0.0, 1.0], [1], [32], rng(), slo=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="SLOs"):
        synthesize_trace([0.0], [1], [32], rng(), slo=0.0)


def test_paper_trace_on_a_small_table_is_deterministic_and_filtered(tmp_path):
    table = write(
        tmp_path / "l.csv",
        "num_prefill_tokens,num_decode_tokens\n100,1\n4000,200\n50,300\n",
    )
    trace = paper_trace(seed=3, peak_rps=2.0, lengths_path=table, minutes_per_hour=0.5)
    assert set(zip(trace.prompt_tokens.tolist(), trace.output_tokens.tolist())) == {
        (100, 32),
        (50, 320),
    }  # (4000, 200 -> 224) is over 4,096 and never drawn
    assert trace.duration < 24 * 30
    same = paper_trace(seed=3, peak_rps=2.0, lengths_path=table, minutes_per_hour=0.5)
    assert np.array_equal(trace.arrival, same.arrival)
    assert np.array_equal(trace.output_tokens, same.output_tokens)


def test_paper_trace_from_sharegpt_first_turns():
    if not SHAREGPT_FIRST_TURNS.exists():
        pytest.skip(f"{SHAREGPT_FIRST_TURNS} absent (CI clone without ../shared)")
    trace = paper_trace(seed=0)
    # seed 0 gives 64,122 requests over 7,200 s (the paper: 63,736), and lengths
    #   prompt mean 233 / p50  36 / p90 688 / p99 2855 (paper: 140 / 28 / 344 / 1698)
    #   output mean 334 / p50 288 / p90 672 / p99  992 (paper: 264 / 224 / 544 / 928)
    assert 62_000 < len(trace) < 66_500 and trace.duration < 7_200
    assert np.all(trace.output_tokens % 32 == 0) and trace.output_tokens.min() >= 32
    assert np.all(trace.prompt_tokens + trace.output_tokens <= 4096)
    assert 20 < length_stats(trace.prompt_tokens)["p50"] < 60
    assert 250 < length_stats(trace.output_tokens)["p50"] < 320


def test_paper_trace_can_draw_from_the_sharegpt_length_table():
    if not SHAREGPT_LENGTHS.exists():
        pytest.skip(f"{SHAREGPT_LENGTHS} absent (CI clone without ../shared)")
    trace = paper_trace(seed=0, lengths_path=SHAREGPT_LENGTHS)
    # prompt mean 1281 / p50 1055 / p90 2931 / p99 3708; output mean 440 / p50 416 / p99 1024
    stats = length_stats(trace.output_tokens)
    assert stats["p99"] == 1024.0 and 400 < stats["mean"] < 480
    assert 1000 < length_stats(trace.prompt_tokens)["p50"] < 1120


def test_a_poisson_trace_name_gives_its_rate_and_seconds_or_says_what_it_must_be():
    assert parse_poisson("poisson:2.5:30") == (2.5, 30.0)
    for bad in ("poisson:abc:10", "poisson:5", "poisson:1:2:3"):
        with pytest.raises(ValueError, match="poisson:RPS:SECONDS"):
            parse_poisson(bad)


def test_a_fixed_length_trace_gives_every_request_the_lengths_it_names():
    spec = SimulationSpec(trace="fixed:4:30:1020:250", block_len=32)
    trace = make_trace(spec)
    assert 60 < len(trace) < 180  # Poisson, 4/s for 30 s
    assert set(trace.prompt_tokens.tolist()) == {1020}
    assert set(trace.output_tokens.tolist()) == {256}  # rounded up to whole blocks
    assert parse_fixed("fixed:2:10:256:1024") == (2.0, 10.0, 256, (1024,))
    for bad in ("fixed:2:10:256", "fixed:2:10:a:256", "fixed:2:10:256:1.5", "fixed:2:10:256:32/"):
        with pytest.raises(ValueError, match="fixed:RPS:SECONDS:PROMPT:OUTPUT"):
            parse_fixed(bad)
    with pytest.raises(ValueError, match="output > 0"):
        parse_fixed("fixed:2:10:256:64/0")


def test_a_fixed_trace_with_several_outputs_draws_each_request_one_of_them():
    trace = make_trace(SimulationSpec(trace="fixed:10:60:256:256/1000", block_len=32))
    outputs = trace.output_tokens.tolist()
    assert set(outputs) == {256, 1024} and set(trace.prompt_tokens.tolist()) == {256}
    assert 0.35 < outputs.count(256) / len(outputs) < 0.65
