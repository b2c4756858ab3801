"""`dilaserve simulate` reaches every field of `SimulationSpec`, from options or a --config file,
and a run's config.json gives back the spec it ran."""

import dataclasses
import json

import pytest

from dilaserve.cli import build_parser
from dilaserve.cli_args import apply_config_file
from dilaserve.sim.spec import SimulationSpec

# a value other than the default for every field, as it would be typed on the command line
NON_DEFAULT = {
    "policy": ("llumnix", "llumnix"),
    "profile": ("llada2-mini-h200", "llada2-mini-h200"),
    "trace": ("poisson:2:10", "poisson:2:10"),
    "peak_rps": ("7.5", 7.5),
    "minutes_per_hour": ("2", 2.0),
    "duration": ("60", 60.0),
    "rate_scale": ("1.5", 1.5),
    "gpus": ("8", 8),
    "gpus_per_node": ("8", 8),
    "initial_tp": ("2", 2),
    "initial_layout": ("2x2,1x4", "2x2,1x4"),
    "stragglers": ("1:1.5", "1:1.5"),
    "measured_speed": (None, True),
    "instance_speed": (None, True),
    "slo": ("3.5", 3.5),
    "slo_multiple": ("4", 4.0),
    "kv_cache": ("block", "block"),
    "block_len": ("16", 16),
    "threshold": ("0.8", 0.8),
    "max_batch_tokens": ("4096", 4096),
    "max_requests_per_instance": ("32", 32),
    "max_batch_requests": ("12", 12),
    "refresh_every_tokens": ("4", 4),
    "slo_headroom": ("0.5", 0.5),
    "refresh_interval": ("0.1", 0.1),
    "planner_period": ("60", 60.0),
    "startup_delay": ("10", 10.0),
    "serial_launches": (None, True),
    "rate_trend": (None, False),
    "plan_batch_limits": (None, True),
    "latency_noise": ("0.1", 0.1),
    "interval": ("30", 30.0),
    "predictor_prompts": ("12", 12),
    "behaviour": ("replay:t.npz", "replay:t.npz"),
    "predictor_path": ("pred", "pred"),
    "quality": ("q.json", "q.json"),
    "candidates": ("0.7,0.9", (0.7, 0.9)),
    "lost_work": ("late", "late"),
    "quality_budget": ("0.02", 0.02),
    "seed": ("3", 3),
}


def spec_of(argv: list[str]) -> SimulationSpec:
    parser = build_parser()
    args = apply_config_file(parser, parser.parse_args(["simulate", *argv]), ["simulate", *argv])
    names = {f.name for f in dataclasses.fields(SimulationSpec)}
    return SimulationSpec(**{k: v for k, v in vars(args).items() if k in names})


def option(name: str, text: str | None, value) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if text is None:  # a switch
        return [flag if value else "--no-" + flag[2:]]
    return [flag, text]


def test_the_table_covers_every_field():
    assert set(NON_DEFAULT) == {f.name for f in dataclasses.fields(SimulationSpec)}


def test_the_defaults_are_the_specs():
    assert spec_of([]) == SimulationSpec()


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_every_field_is_an_option(name):
    text, value = NON_DEFAULT[name]
    assert getattr(SimulationSpec(), name) != value
    spec = spec_of(option(name, text, value))
    assert getattr(spec, name) == value


def test_simulate_help_shows_every_field_with_its_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["simulate"]
    text = sub.format_help()
    for f in dataclasses.fields(SimulationSpec):
        assert "--" + f.name.replace("_", "-") in text
    assert all(action.help for action in sub._actions)


def test_a_config_file_sets_fields_and_the_command_line_wins(tmp_path):
    path = tmp_path / "sim.toml"
    path.write_text('gpus = 8\nkv-cache = "none"\ncandidates = [0.7, 0.9]\nslo = 2.0\n')
    spec = spec_of(["--config", str(path), "--slo", "4"])
    assert (spec.gpus, spec.kv_cache, spec.candidates, spec.slo) == (8, "none", (0.7, 0.9), 4.0)


def test_a_config_file_with_an_unknown_setting_is_refused(tmp_path):
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"gpus": 8, "gpu_count": 4}))
    with pytest.raises(ValueError, match=r"\['gpu_count'\] are not settings of `simulate`"):
        spec_of(["--config", str(path)])


def test_a_runs_config_json_gives_back_its_spec(tmp_path):
    spec = SimulationSpec(
        policy="infaas", gpus=8, candidates=(0.6, 0.9), slo=2.5, rate_trend=False, duration=30.0
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(spec)))  # as `simulate` writes it
    assert spec_of(["--config", str(path)]) == spec


def test_a_config_file_cannot_set_what_is_no_setting(tmp_path):
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"func": "x"}))
    with pytest.raises(ValueError, match=r"\['func'\] are not settings"):
        spec_of(["--config", str(path)])
