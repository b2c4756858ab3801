"""Traces and the capacity questions `dilaserve plan` answers, on hand-checkable cases."""

import json

import pytest

from dilaserve.cli import main
from dilaserve.control.monitor import WorkloadClass
from dilaserve.sim import capacity
from dilaserve.sim.traces import load_trace

from conftest import PLANNER_PROFILE as PROFILE
from conftest import planner_config as config


def write(path, text):
    path.write_text(text)
    return path


def test_traces_load_by_column_names_in_every_layout(tmp_path):
    own = load_trace(
        write(
            tmp_path / "a.csv", "arrival_time,prompt_tokens,output_tokens,slo\n5,10,20,3\n2,1,2,4\n"
        )
    )
    assert own.arrival.tolist() == [0.0, 3.0] and own.prompt_tokens.tolist() == [1, 10]
    assert own.slo.tolist() == [4.0, 3.0]
    azure = load_trace(
        write(
            tmp_path / "b.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.5000000,374,44\n2023-11-16 18:15:48.7500000,396,109\n",
        )
    )
    assert azure.arrival.tolist() == pytest.approx([0.0, 2.25])
    burst = load_trace(
        write(tmp_path / "c.csv", "Timestamp,Model,Request tokens,Response tokens\n5,x,472,18\n")
    )
    assert burst.output_tokens.tolist() == [18]


def test_bad_traces_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="match no known layout"):
        load_trace(write(tmp_path / "a.csv", "time,in,out\n1,2,3\n"))
    with pytest.raises(ValueError, match="line 3"):
        load_trace(
            write(tmp_path / "b.csv", "arrival_time,prompt_tokens,output_tokens\n1,2,3\n2,x,3\n")
        )
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.csv")


def test_busiest_window_and_classes_with_outputs_rounded_to_blocks(tmp_path):
    rows = "".join(f"{t},64,{40 if t < 100 else 5}\n" for t in (0, 50, 100, 101, 102, 103))
    trace = load_trace(
        write(tmp_path / "t.csv", "arrival_time,prompt_tokens,output_tokens\n" + rows)
    )
    assert len(trace.busiest_window(10.0)) == 4
    [cls] = capacity.workload_classes(trace, slo=2.5, block_len=32, window=10.0, safety=1.0)
    assert cls.output_len == 32 and cls.rate == pytest.approx(0.4) and cls.slo == 2.5


def test_nodes_for_fills_whole_nodes_first():
    assert capacity.nodes_for(10, 4) == (4, 4, 2)
    with pytest.raises(ValueError):
        capacity.nodes_for(0, 4)


def test_smallest_gpu_count_and_capacity_multiple():
    # rate 1.0: one TP-1 instance can take 0.1 x rate x steps <= 1 -> 10 steps, below the 16 of
    # the fastest threshold; two GPUs can (two TP-1: 20 steps, one TP-2: 16.7).
    busy = [WorkloadClass(64, 64, 1.0, 2.5)]
    assert capacity.smallest_gpu_count(busy, PROFILE, config(), per_node=2) == 2
    # 0.4 requests/s on 2 GPUs: two TP-1 instances carry up to 2 / (0.1 x 16) = 1.25 requests/s
    light = [WorkloadClass(64, 64, 0.4, 2.5)]
    assert capacity.capacity_multiple(light, PROFILE, config()) == pytest.approx(3.125, rel=1e-3)


def test_plan_command_writes_a_run_folder(tmp_path, capsys):
    profile = write(tmp_path / "p.json", json.dumps(PROFILE.to_dict()))
    trace = write(
        tmp_path / "t.csv",
        "arrival_time,prompt_tokens,output_tokens\n" + "".join(f"{t},64,64\n" for t in range(4)),
    )
    args = ["plan", "--profile", str(profile), "--trace", str(trace), "--gpus", "2"]
    args += ["--gpus-per-node", "2", "--slo", "2.5", "--tp", "1,2", "--kv-cache", "none"]
    args += ["--tokens-per-step", "0.5:4,0.9:2", "--window", "10", "--out", str(tmp_path)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "configuration: 1 x TP-2" in out
    [folder] = tmp_path.glob("plan-*")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["instances"] == {"2": 1} and summary["smallest_gpus"] == 1
    assert "configuration: feasible" in err  # progress, on stderr, as each check ends
    assert "capacity: 1 x the workload is feasible" in err
    assert "smallest GPU count: 1 GPUs keep the SLO" in err


def test_plan_names_the_step_predictor_it_takes_tokens_per_step_from(tmp_path, capsys):
    profile = write(tmp_path / "p.json", json.dumps(PROFILE.to_dict()))
    trace = write(tmp_path / "t.csv", "arrival_time,prompt_tokens,output_tokens\n0,64,64\n")
    args = ["plan", "--profile", str(profile), "--trace", str(trace), "--gpus", "1"]
    args += ["--slo", "2.5", "--tp", "1", "--kv-cache", "none", "--out", str(tmp_path)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "from step predictor" in err and "(the bundled tiny model's:" in err
