"""A user's own checkpoint, end to end: calibrate it at TP 1 and 2, serve it on a mixed layout
through the command line, and have the official openai client use it; a calibration made for
another model is refused with the command that would make the right one.

The checkpoint is random-weight, written at test time in LLaDA-8B-Instruct's file layout
(config.json with the published keys, sharded safetensors with an index, tokenizer files,
generation_config.json), with the dimensions shrunk.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from dilaserve.calibration.latency import Point, ProfileGrid, measure_curve
from dilaserve.calibration.store import (
    CalibrationMissing,
    model_key,
    resolve_control_inputs,
)
from dilaserve.cli import main
from dilaserve.config import BUNDLED_MODEL, BUNDLED_PREDICTOR
from dilaserve.control.profile import LatencyProfile
from dilaserve.models.generation import default_max_tokens
from dilaserve.protocol import StepKind
from dilaserve.training.random_checkpoint import write_random_llada

from conftest import HANG_GUARD_S

CALIBRATE = ["--requests", "1,2", "--repeats", "1", "--num-prompts", "6"]
CALIBRATE += ["--max-tokens", "32"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A checkpoint calibrated at TP 1 and 2 by `dilaserve calibrate`, and what it printed."""
    folder = write_random_llada(tmp_path_factory.mktemp("LLaDA-8B-Instruct-tiny"))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["calibrate", str(folder), "--tp", "1,2", *CALIBRATE]) == 0
    return folder, out.getvalue()


def test_calibrate_measures_every_tp_degree_and_keys_the_folder(calibrated):
    model, printed = calibrated
    folder = model / "dilaserve-calibration" / "cpu-float32"
    meta = json.loads((folder / "calibration.json").read_text())
    assert meta["tp"] == [1, 2]
    assert meta["key"] == {
        "model": model.name,
        "config_sha256": model_key(model, "cpu", "float32").config_sha256,
        "device": "cpu",
        "dtype": "float32",
    }
    profile = LatencyProfile.from_file(folder / "profile.json")
    for tp in (1, 2):
        assert profile.curve(tp, StepKind.RECOMPUTE).tokens == (64, 128)
        assert profile.curve(tp, StepKind.CACHE).tokens == (32, 64)
    assert (folder / "predictor" / "gbm-full.txt").is_file()
    assert {"config.json", "records.csv", "summary.json", "report.md"} <= {
        p.name for p in folder.iterdir()
    }
    assert "[1/13] tp=1 recompute step" in printed and "left)" in printed


def test_profile_only_adds_a_tp_degree_and_keeps_the_rest(calibrated, tmp_path):
    model, _ = calibrated
    copy = tmp_path / "calibration"
    shutil.copytree(model / "dilaserve-calibration" / "cpu-float32", copy)
    predictor = (copy / "predictor" / "gbm-full.txt").read_text()
    before = LatencyProfile.from_file(copy / "profile.json")
    argv = ["calibrate", str(model), "--tp", "2", "--profile-only", "--calibration", str(copy)]
    assert main([*argv, "--requests", "1", "--repeats", "1", "--max-tokens", "32"]) == 0
    after = LatencyProfile.from_file(copy / "profile.json")
    assert after.curve(1, StepKind.CACHE) == before.curve(1, StepKind.CACHE)
    assert after.curve(2, StepKind.CACHE).tokens == (32,)
    assert (copy / "predictor" / "gbm-full.txt").read_text() == predictor
    assert json.loads((copy / "calibration.json").read_text())["tp"] == [1, 2]


def test_serving_a_model_with_another_models_calibration_is_refused(calibrated, tmp_path, capsys):
    model, _ = calibrated
    other = write_random_llada(tmp_path / "other", seed=1, rope_theta=10000.0)
    theirs = model / "dilaserve-calibration" / "cpu-float32"
    assert main(["serve", str(other), "--calibration", str(theirs), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        f"no calibration for other on cpu float32 tp=1 ({theirs} was made for {model.name}" in err
    )
    assert f"run: dilaserve calibrate {other} --device cpu --dtype float32 --tp 1" in err
    assert len(err.strip().splitlines()) == 1


def test_an_uncalibrated_model_or_tp_degree_says_what_to_run(calibrated, tmp_path, capsys):
    model, _ = calibrated
    assert main(["serve", str(model), "--tp", "4", "--instances", "1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "covers tp=1,2 only" in err and "--tp 4" in err
    other = write_random_llada(tmp_path / "fresh", seed=2)
    assert main(["run-trace", str(other)]) == 2
    assert "no calibration for fresh on cpu float32 tp=1" in capsys.readouterr().err


def test_calibrate_at_start_up_when_none_matches(tmp_path, monkeypatch):
    """`serve --calibrate` calibrates first, explicitly; building the configuration never does."""
    import dataclasses

    import dilaserve.calibration.run as run
    from dilaserve.calibration.store import CalibrationMissing
    from dilaserve.cli import build_parser
    from dilaserve.cli_args import resolve_model
    from dilaserve.cli_cluster import calibrate_if_missing, cluster_config, control_inputs

    real, seen = run.calibrate, []

    def small(cfg, log=print):  # the defaults, cut down to a test's size
        seen.append(cfg)
        return real(dataclasses.replace(cfg, requests=(1,), repeats=1, num_prompts=6), log)

    monkeypatch.setattr(run, "calibrate", small)
    model = write_random_llada(tmp_path / "fresh", seed=3)
    args = build_parser().parse_args(["serve", str(model), "--calibrate"])
    resolve_model(args)
    with pytest.raises(CalibrationMissing):
        cluster_config(args)
    assert seen == []
    assert calibrate_if_missing(args)  # it calibrated, and said the warnings
    inputs = control_inputs(args, {1})
    assert [c.tp for c in seen] == [(1,)]
    assert not calibrate_if_missing(args)  # now one matches: nothing to do
    assert len(seen) == 1
    assert inputs.label["source"] == "calibrated" and inputs.label["tp"] == [1]
    assert inputs.profile == str(model / "dilaserve-calibration" / "cpu-float32" / "profile.json")


def test_a_ray_head_without_gpus_takes_the_device_from_the_calibration(calibrated):
    """On a Ray cluster the GPUs may all be on other machines than `serve`'s."""
    from dilaserve.cli import build_parser
    from dilaserve.cli_cluster import _device_name

    model, _ = calibrated
    folder = str(model / "dilaserve-calibration" / "cpu-float32")
    argv = ["serve", str(model), "--device", "cuda", "--calibration", folder]
    assert _device_name(build_parser().parse_args([*argv, "--backend", "ray"])) == "cpu"
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        _device_name(build_parser().parse_args(argv))


def test_presets_are_accepted_by_name_and_labelled(calibrated):
    model, _ = calibrated
    key = model_key(model, "cpu", "float32")
    inputs = resolve_control_inputs(
        model, key, {1, 2}, "cpu", profile="llada-8b-h100", predictor=str(BUNDLED_PREDICTOR)
    )
    assert inputs.label == {"source": "preset", "name": "llada-8b-h100"}
    assert LatencyProfile.from_file(inputs.profile).tp_degrees == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="has no points for tp=2"):
        resolve_control_inputs(
            model, key, {2}, "cpu", profile="llada-8b-h200", predictor=str(BUNDLED_PREDICTOR)
        )
    mixed = resolve_control_inputs(model, key, {1}, "cpu", profile="llada-8b-h100")
    assert mixed.label["source"] == "calibrated" and mixed.label["profile"]["source"] == "preset"
    with pytest.raises(CalibrationMissing, match="or give --predictor"):
        resolve_control_inputs(model, key, {4}, "cpu", profile="llada-8b-h100")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mixed_server(calibrated):
    """`dilaserve serve MODEL --layout 2,1` as a user starts it: one TP-2 and one TP-1 instance."""
    model, _ = calibrated
    port = _free_port()
    command = [sys.executable, "-m", "dilaserve.cli", "serve", str(model), "--layout", "2,1"]
    command += ["--port", str(port), "--log-interval", "0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        assert server.poll() is None, server.stdout.read()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    yield model, url
    server.terminate()
    server.wait(HANG_GUARD_S)


@pytest.mark.slow
def test_a_mixed_layout_serves_the_openai_client(mixed_server):
    model, url = mixed_server
    health = httpx.get(f"{url}/health").json()
    assert health["instances"] == {"1": 1, "2": 1}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    assert name == model.name
    listed = httpx.get(f"{url}/v1/models").json()["data"][0]["dilaserve"]["calibration"]
    assert listed["source"] == "calibrated" and listed["tp"] == [1, 2]
    reply = client.completions.create(model=name, prompt="Tom has 3 apples.", max_tokens=32)
    assert reply.usage.completion_tokens <= 32 and reply.choices[0].finish_reason
    pieces = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    assert [c for c in pieces if c.choices and c.choices[0].finish_reason]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=8)


def test_measurements_that_stay_implausible_are_reported():
    grid = ProfileGrid(64, 32, (1, 2, 4), repeats=3, retries=2)

    class Timer:
        """Steps take 10 ms per 32 tokens; the one-request cache step is noisy in its first
        `noisy` measurements (4 runs each: a warm-up and 3 repeats)."""

        def __init__(self, noisy: int):
            self.noisy, self.calls = noisy, 0

        def run(self, batch):
            n, is_cache = len(batch), batch.items[0].kind is StepKind.CACHE
            tokens = n * (32 if is_cache else 64)
            seconds = tokens / 3200
            if n == 1 and is_cache:
                if self.calls // 4 < self.noisy:
                    seconds *= 1 + self.calls % 4  # repeats 2x, 3x, 4x: spread 67%
                self.calls += 1
            return seconds, tokens

        def release(self, ids):
            pass

    points, warnings = measure_curve(Timer(noisy=1), grid, 5, StepKind.CACHE, [1, 2, 4], print)
    assert warnings == [] and [round(p.ms, 3) for p in points] == [10.0, 20.0, 40.0]
    points, warnings = measure_curve(Timer(noisy=99), grid, 5, StepKind.CACHE, [1, 2, 4], print)
    assert len(warnings) == 1 and "cache step of 32 tokens: repeats spread" in warnings[0]
    assert "still after 2 re-measurements" in warnings[0]


def test_a_small_step_far_slower_than_a_larger_one_is_implausible():
    from dilaserve.calibration.latency import implausible

    grid = ProfileGrid(64, 32)
    points = [Point(1, 32, 685.0, 0.0), Point(2, 64, 11.0, 0.0), Point(4, 128, 20.0, 0.0)]
    assert set(implausible(points, grid)) == {1, 2, 4}
    assert implausible([Point(1, 32, 15.0, 0.0), Point(2, 64, 11.0, 0.0)], grid) == {}


def test_the_output_window_defaults_to_the_checkpoints_generation_config(tmp_path):
    assert default_max_tokens(BUNDLED_MODEL) == 64
    assert default_max_tokens(tmp_path) == 256
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 512}')
    assert default_max_tokens(tmp_path) == 512
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": "many"}')
    with pytest.raises(ValueError, match="max_new_tokens='many'"):
        default_max_tokens(tmp_path)


def test_instance_layouts_read_unambiguously(capsys):
    from dilaserve.cli import build_parser
    from dilaserve.cli_cluster import layout

    def parse(*argv):
        return layout(build_parser().parse_args(["serve", *argv]))

    assert parse() == (1, 1)
    assert parse("--tp", "2", "--instances", "3") == (2, 2, 2)
    assert parse("--layout", "2,1") == (2, 1)
    with pytest.raises(ValueError, match="use --layout 1,1"):
        parse("--instances", "1,1")
    with pytest.raises(ValueError, match="not both"):
        parse("--layout", "2,1", "--tp", "2")


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("dilaserve ")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "(default: dilaserve)" in capsys.readouterr().out


def test_a_model_that_fails_to_load_is_one_error_line(tmp_path, capsys):
    model = write_random_llada(tmp_path / "broken")
    (model / "model-00002-of-00003.safetensors").unlink()
    argv = ["serve", str(model), "--profile", "llada-8b-h100", "--predictor"]
    argv += [str(BUNDLED_PREDICTOR), "--layout", "1", "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "instance i0 failed" in err and "model-00002-of-00003.safetensors" in err
