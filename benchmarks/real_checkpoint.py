"""A user's own checkpoint from nothing to answered requests, as the recipes in docs/recipes.md
run it: write a random-weight checkpoint in LLaDA-8B-Instruct's layout, `dilaserve calibrate`
it at the TP degrees given, `dilaserve serve` it on a layout, and replay a trace against it
with `dilaserve bench`. Every command is a subprocess, as a user types it.

    python benchmarks/real_checkpoint.py                          # tiny shape, CPU, TP 1,2
    python benchmarks/real_checkpoint.py --shape llada-8b --device cuda --dtype bfloat16 \
        --tp 1 --layout 1 --requests 1,2,4,8,16,32,64

Writes a run folder: config.json, calibrate.log, serve.log, the bench's records.csv and
summary.json, and report.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dilaserve.runs import create_run_dir, environment, write_json
from dilaserve.training.random_checkpoint import write_random_llada

SHAPES = {
    "tiny": {},
    "llada-8b": {  # LLaDA-8B-Instruct's published dimensions (the bundled tokenizer's ids fit)
        "d_model": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 32,
        "mlp_hidden_size": 12288,
        "embedding_size": 126464,
        "vocab_size": 126464,
    },
}


def run(command: list[str], log: Path) -> str:
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    print(done.stdout[-3000:] + done.stderr[-3000:], flush=True)
    if done.returncode:
        raise SystemExit(f"{command[1]} failed with {done.returncode}; see {log}")
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [*DILASERVE, "serve", str(model), "--layout", args.layout, "--port", str(port)]
    command += ["--device", args.device, "--dtype", args.dtype, "--log-interval", "5"]
    print("$ " + " ".join(command), flush=True)
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"serve exited with {server.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise SystemExit(f"serve did not come up in {args.start_timeout} s; see {log}")


DILASERVE = [sys.executable, "-m", "dilaserve.cli"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", default="1,2", help="TP degrees to calibrate")
    p.add_argument("--layout", default="2,1", help="TP degree of each served instance")
    p.add_argument("--requests", default="1,2,4,8,16", help="calibrate's batch sizes")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--trace", default="poisson:4:20")
    p.add_argument("--slo-ms", type=float, default=2000.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default="runs")
    args = p.parse_args()

    folder = create_run_dir(args.out, "real-checkpoint")
    write_json(folder / "config.json", {**vars(args), "environment": environment()})
    model = write_random_llada(folder / "LLaDA-8B-Instruct-random", **SHAPES[args.shape])
    calibrate = [*DILASERVE, "calibrate", str(model), "--tp", args.tp, "--device", args.device]
    calibrate += ["--dtype", args.dtype, "--requests", args.requests]
    calibrate += ["--num-prompts", str(args.num_prompts)]
    run(calibrate, folder / "calibrate.log")
    server, url = serve(model, args, folder / "serve.log")
    try:
        bench = [*DILASERVE, "bench", "--url", url, "--trace", args.trace, "--slo-ms"]
        bench += [str(args.slo_ms), "--endpoint", "completions", "--out", str(folder / "bench")]
        printed = run(bench, folder / "bench.log")
    finally:
        server.terminate()
        server.wait(120)
    report(folder, model, printed)
    shutil.rmtree(model)  # the weights; the calibration was copied into the run folder


def report(folder: Path, model: Path, bench_printed: str) -> None:
    """summary.json and report.md from the calibration and the bench; the weights are deleted
    (the calibration is kept beside the report)."""
    calibration = next((model / "dilaserve-calibration").iterdir())
    shutil.copytree(calibration, folder / "calibration", ignore=shutil.ignore_patterns("*.npz"))
    bench_run = next((folder / "bench").iterdir())
    summary = {
        "calibration": json.loads((calibration / "calibration.json").read_text())["key"],
        "calibration_summary": json.loads((calibration / "summary.json").read_text()),
        "bench": json.loads((bench_run / "summary.json").read_text()),
    }
    write_json(folder / "summary.json", summary)
    calibrate_log = (folder / "calibrate.log").read_text()
    (folder / "report.md").write_text(
        f"# a checkpoint in LLaDA-8B-Instruct's layout: calibrate, serve, bench\n\n"
        f"## dilaserve calibrate\n\n```\n{calibrate_log}```\n\n"
        f"## dilaserve bench against dilaserve serve\n\n```\n{bench_printed}```\n"
    )
    print(f"run folder: {folder}")


if __name__ == "__main__":
    main()
