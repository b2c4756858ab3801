"""A run's dashboard: its data file read back, `dilaserve dashboard RUN` serving the shared page
and the run's data over HTTP (and nothing else of the folder), and `--html` writing one page
that embeds the data."""

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

from dilaserve.cli import main
from dilaserve.dashboard.page import DATA_FILE, read_data, write_data
from dilaserve.dashboard.serve import create_server
from dilaserve.dashboard.timeline import Timeline

META = {"source": "simulation", "model": "m", "policy": "fcfs", "calibration": None, "slo_s": 1.0}


@pytest.fixture
def run_folder(tmp_path):
    t = Timeline(interval=1.0, keep=10)
    t.request_done(0.5, 0.2, True, 0, [0.9], 4)
    t.request_done(1.5, 0.4, False, 0, [0.8], 4)
    data = {**t.to_json(2.0, META), "note": "</script> stays text"}
    write_data(data, tmp_path)
    (tmp_path / "summary.json").write_text('{"private": true}')
    return tmp_path


@pytest.fixture
def served(run_folder):
    server = create_server(run_folder, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_the_data_file_reads_back_as_written(run_folder):
    data = read_data(run_folder)
    assert data["totals"]["finished"] == 2 and data["note"] == "</script> stays text"
    assert "</script>" not in (run_folder / DATA_FILE).read_text()  # escaped, as when inlined


def test_a_folder_without_data_or_with_bad_data_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no {DATA_FILE} in {tmp_path}"):
        read_data(tmp_path)
    (tmp_path / DATA_FILE).write_text("window.DASHBOARD = {not json};")
    with pytest.raises(ValueError, match="not JSON"):
        read_data(tmp_path)
    (tmp_path / DATA_FILE).write_text("alert(1)")
    with pytest.raises(ValueError, match="is not `window.DASHBOARD = "):
        read_data(tmp_path)


def test_the_server_answers_the_page_its_parts_and_the_runs_data(served, run_folder):
    status, kind, page = get(served.url)
    assert status == 200 and kind.startswith("text/html")
    assert f'<script src="{DATA_FILE}"></script>' in page  # the shared page, not a copy
    assert '<script src="dashboard.js"></script>' in page and "function lineChart" not in page
    status, kind, script = get(served.url + DATA_FILE)
    assert status == 200 and kind.startswith("text/javascript")
    assert script == (run_folder / DATA_FILE).read_text()
    status, _, js = get(served.url + "dashboard.js")
    assert status == 200 and "function lineChart" in js
    status, _, css = get(served.url + "dashboard.css")
    assert status == 200 and "body {" in css


def test_the_server_serves_nothing_else_of_the_folder(served):
    for path in ("summary.json", "../summary.json", "static/dashboard.js", "x/"):
        status, _, _ = get(served.url + path)
        assert status == 404, path


def test_the_server_refuses_a_folder_without_data_or_a_bad_port(tmp_path):
    with pytest.raises(FileNotFoundError, match=DATA_FILE):
        create_server(tmp_path)
    with pytest.raises(ValueError, match="port"):
        create_server(tmp_path, port=70000)


def test_html_writes_one_page_that_embeds_the_data(run_folder, tmp_path, capsys):
    out = tmp_path / "shared.html"
    assert main(["dashboard", str(run_folder), "--html", str(out)]) == 0
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=""", page)  # nothing to fetch
    assert "function lineChart" in page and "<style>" in page
    literal = re.search(r"window\.DASHBOARD = (.*);\n", page).group(1)
    assert json.loads(literal)["data"] == read_data(run_folder)
    assert str(out) in capsys.readouterr().out


def test_the_command_names_a_folder_without_data(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "nothing")]) == 2
    assert f"no {DATA_FILE} in" in capsys.readouterr().err
