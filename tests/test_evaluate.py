import csv
import io
import json
from types import SimpleNamespace

import pytest

from dilaserve.cli import main
from dilaserve.tasks.evaluate import EvalConfig, ProgressLine, evaluate

from conftest import SHARED_DATA, write_tiny_checkpoint


def test_eval_bundled_task_writes_a_run_folder(tiny_checkpoint, tmp_path):
    cfg = EvalConfig(
        model=str(tiny_checkpoint),
        thresholds=(0.5, 1.0),
        num_problems=6,
        max_tokens=32,
        out=str(tmp_path),
    )
    run = evaluate(cfg, log=lambda *_: None)
    summary = json.loads((run / "summary.json").read_text())
    assert [row["threshold"] for row in summary["table"]] == [0.5, 1.0]
    assert json.loads((run / "config.json").read_text())["num_problems"] == 6
    records = list(csv.DictReader((run / "records.csv").open()))
    assert len(records) == 12
    at_one = [int(r["steps"]) for r in records if r["threshold"] == "1.0"]
    at_half = [int(r["steps"]) for r in records if r["threshold"] == "0.5"]
    assert all(s >= 1 for s in at_one) and sum(at_half) <= sum(at_one)
    assert "| threshold | accuracy |" in (run / "report.md").read_text()


def test_progress_line_shows_problems_done_and_time_left():
    clock = iter([100.0, 100.5, 102.0, 102.1, 104.0, 105.0])
    stream = io.StringIO()
    line = ProgressLine("threshold 0.5", 20, stream, clock=lambda: next(clock))
    step, finished = SimpleNamespace(is_finished=False), SimpleNamespace(is_finished=True)
    line.on_step(None, step)  # a step that finishes nothing counts nothing
    line.on_step(None, finished)  # 1 of 20: too few to estimate from
    line.done = 9
    line.on_step(None, finished)  # 10 done in 2 s: 10 left, 2 s
    line.on_step(None, finished)  # 0.1 s after the last draw: not redrawn
    line.done = 18
    line.on_step(None, finished)  # 19 done in 4 s
    line.on_step(None, finished)  # the last is always drawn
    drawn = stream.getvalue().split("\r")[1:]
    assert [d.strip() for d in drawn] == [
        "threshold 0.5: 1/20 problems, time left: estimating",
        "threshold 0.5: 10/20 problems, 2 s left",
        "threshold 0.5: 19/20 problems, 0 s left",
        "threshold 0.5: 20/20 problems, 0 s left",
    ]
    line.close()
    assert stream.getvalue().endswith("\r" + " " * len(drawn[0]) + "\r")  # the line is cleared


def test_eval_shows_progress_on_stderr_per_threshold(tiny_checkpoint, tmp_path, capsys):
    cfg = EvalConfig(
        model=str(tiny_checkpoint),
        thresholds=(0.5, 0.9),
        num_problems=3,
        max_tokens=32,
        out=str(tmp_path),
    )
    evaluate(cfg, log=lambda *_: None)
    err = capsys.readouterr().err
    assert "threshold 0.5: 3/3 problems, 0 s left" in err
    assert "threshold 0.9: 3/3 problems, 0 s left" in err
    evaluate(cfg, log=lambda *_: None, show_progress=False)
    assert capsys.readouterr().err == ""


def test_eval_gsm8k_format_path(tiny_checkpoint, tmp_path):
    data = SHARED_DATA / "eval" / "gsm8k_test.jsonl"
    if not data.exists():
        pytest.skip("shared GSM8K data not present")
    cfg = EvalConfig(
        model=str(tiny_checkpoint),
        task="gsm8k",
        thresholds=(0.9,),
        num_problems=3,
        max_tokens=32,
        data=str(data),
        out=str(tmp_path),
    )
    run = evaluate(cfg, log=lambda *_: None)
    records = list(csv.DictReader((run / "records.csv").open()))
    assert [int(r["gold"]) for r in records] == [18, 3, 70000]  # first three GSM8K answers


def test_eval_config_errors_name_the_field(tiny_checkpoint):
    with pytest.raises(ValueError, match="task"):
        EvalConfig(model=str(tiny_checkpoint), task="mmlu")
    with pytest.raises(ValueError, match="threshold"):
        EvalConfig(model=str(tiny_checkpoint), thresholds=(0.0,))
    with pytest.raises(FileNotFoundError, match="--data"):
        evaluate(
            EvalConfig(
                model=str(tiny_checkpoint), task="gsm8k", data="/no/such.jsonl", num_problems=1
            ),
            log=lambda *_: None,
        )


def test_cli_generate_and_clear_errors(tiny_checkpoint, capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_checkpoint),
                "--prompt",
                "Tom has 3 apples.",
                "--max-tokens",
                "16",
                "--threshold",
                "0.5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("### Tom has 3 apples.") and "steps" in out
    assert (
        main(["generate", "--model", str(tiny_checkpoint), "--prompt", "x", "--threshold", "1.5"])
        == 2
    )
    assert "threshold" in capsys.readouterr().err
    assert main(["generate", "--model", "/no/such/model", "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad_device = ["generate", "--model", str(tiny_checkpoint), "--prompt", "x", "--device", "gpu"]
    assert main(bad_device) == 2
    assert "device 'gpu' is not a torch device" in capsys.readouterr().err


def test_cli_generate_in_bfloat16(tiny_checkpoint, capsys):
    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", "Tom has 3 apples."]
    assert main([*args, "--max-tokens", "8", "--dtype", "bfloat16"]) == 0
    assert "steps" in capsys.readouterr().out


def test_eval_keeps_the_models_quality_curve(tmp_path, capsys):
    """`eval --keep-curve` keeps the accuracy per threshold beside the model, in its calibration
    folder for the device and dtype, where `serve` finds it (`calibration/store.py`)."""
    model = write_tiny_checkpoint(tmp_path / "model")
    args = ["eval", "--model", str(model), "--num", "4", "--max-tokens", "32", "--out"]
    args += [str(tmp_path / "runs"), "--thresholds", "0.5,0.9", "--keep-curve"]
    assert main(args) == 0
    kept = model / "dilaserve-calibration" / "cpu-float32" / "quality.json"
    run = json.loads(next((tmp_path / "runs").glob("eval-*/summary.json")).read_text())
    curve = json.loads(kept.read_text())
    assert curve["table"] == run["table"] and [r["threshold"] for r in run["table"]] == [0.5, 0.9]
    assert curve["settings"]["num_problems"] == 4 and "model" not in curve["settings"]
    assert str(kept) in capsys.readouterr().out
    assert main([*args[:-3], "--thresholds", "0.9", "--keep-curve"]) == 2  # one point: no curve
    assert "two thresholds or more" in capsys.readouterr().err
