"""The README's Python example, run verbatim against `dilaserve serve` started as `make serve`
starts it (the Makefile's own command line, on a free port): it prints what the README says it
prints, whatever threshold the policy picks, for the whole answer or step by step."""

import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from dilaserve.config import SamplingParams
from dilaserve.control.policy import DEFAULT_CANDIDATES
from dilaserve.engine.llm import LLM
from dilaserve.protocol import StepBatch

from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
README_ADDRESS = "127.0.0.1:8000"
FENCED_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
START_TIMEOUT_S = HANG_GUARD_S  # model and workers load, on a busy machine


def readme_example() -> tuple[str, str]:
    """(the Python block that calls the server, the ```text block after it: what it prints)."""
    blocks = FENCED_BLOCK.findall((ROOT / "README.md").read_text())
    for i, (lang, body) in enumerate(blocks[:-1]):
        if lang == "python" and "OpenAI(" in body:
            assert blocks[i + 1][0] == "text", "the README's example must be followed by its output"
            return body, blocks[i + 1][1]
    raise AssertionError("README.md has no ```python block that uses the openai client")


def make_serve_command(port: int) -> list[str]:
    """The `serve` target's command from the Makefile, with this interpreter's bin folder and
    `port` (make's defaults otherwise)."""
    recipe = re.search(r"^serve:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has no serve target"
    line = recipe.group(1).replace("$(VENV)/bin/", f"{Path(sys.executable).parent}/")
    return shlex.split(line.replace("$(PORT)", str(port)))


def readme_question() -> str:
    """The question the example asks: what its lines before the request define."""
    code, _ = readme_example()
    setup = {}
    exec(code.split("reply = ")[0], setup)  # builds the client; sends nothing
    return setup["question"]


def replay(llm: LLM, question: str, thresholds: tuple[float, ...]):
    """One request of `question` stepped once per threshold in `thresholds` (or until it
    finishes): (the request, whether it finished)."""
    (request,) = llm.make_requests([question], SamplingParams(max_tokens=64))
    request.request_id = ",".join(map(str, thresholds))
    for step, threshold in enumerate(thresholds):
        request.threshold = threshold
        item = request.step_item(llm.config.kv_cache, on_instance=step > 0)
        request.apply(llm.engine.execute(StepBatch((item,))).results[0])
        if request.is_finished:
            return request, True
    llm.engine.release(request.request_id)
    return request, False


def answers_under_every_mix(llm: LLM, question: str, thresholds) -> set[str]:
    """The answers `question` gets when each step may run at any of `thresholds`: every sequence
    of choices, breadth first; sequences that reach the same state go on as one."""
    frontier, answers = [()], set()
    while frontier:
        states = {}
        for prefix in frontier:
            for threshold in thresholds:
                request, finished = replay(llm, question, (*prefix, threshold))
                if finished:
                    ids = request.generated_ids(llm.tokenizer.special.stop_ids)
                    answers.add(llm.tokenizer.decode(ids))
                    continue
                state = (tuple(request.output_ids.tolist()), request.current_block)
                states.setdefault(state, (*prefix, threshold))
        frontier = list(states.values())
    return answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"dilaserve serve exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"dilaserve serve did not come up:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory):
    """`make serve` on a free port; yields its address as host:port."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            make_serve_command(port), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    address = f"127.0.0.1:{port}"
    try:
        wait_until_healthy(process, f"http://{address}", log)
        yield address
    finally:
        stop(process)


@pytest.mark.slow
def test_the_readme_example_prints_what_the_readme_says(make_serve):
    code, printed = readme_example()
    assert code.count(README_ADDRESS) == 1, "the example's base_url is make serve's address"
    run = subprocess.run(
        [sys.executable, "-c", code.replace(README_ADDRESS, make_serve)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == printed


@pytest.mark.slow
def test_the_readme_question_gets_that_answer_at_every_candidate_threshold(make_serve):
    _, printed = readme_example()
    client = openai.OpenAI(base_url=f"http://{make_serve}/v1", api_key="unused", max_retries=0)
    for threshold in DEFAULT_CANDIDATES:
        reply = client.chat.completions.create(
            model="tiny-llada",
            messages=[{"role": "user", "content": readme_question()}],
            extra_body={"threshold": threshold},
        )
        assert reply.choices[0].message.content + "\n" == printed, threshold


def test_the_readme_answer_holds_under_any_mix_of_thresholds_step_by_step():
    """The policy may pick another threshold at every step of a request."""
    _, printed = readme_example()
    answers = answers_under_every_mix(LLM(), readme_question(), DEFAULT_CANDIDATES)
    assert {answer + "\n" for answer in answers} == {printed}
