"""Chat templates render as Hugging Face's `apply_chat_template` renders them: the published
templates of LLaDA, Dream and LLaDA2 against renders made by transformers (fixtures, and live
when transformers is installed), and each part of the environment those templates expect."""

import json
from datetime import datetime
from pathlib import Path

import pytest

from dilaserve.models import chat_template
from dilaserve.models.chat_template import compile_chat_template, render

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "chat_templates").glob("*.json"))
CASES = [
    (path, case["name"]) for path in FIXTURES for case in json.loads(path.read_text())["cases"]
]


def ours(fixture: dict, case: dict) -> str:
    template = compile_chat_template(fixture["chat_template"])
    return render(
        template,
        case["messages"],
        tools=case.get("tools"),
        add_generation_prompt=case["add_generation_prompt"],
        **chat_template.special_tokens(fixture["special_tokens"]),
    )


def fixture_case(path: Path, name: str) -> tuple[dict, dict]:
    fixture = json.loads(path.read_text())
    return fixture, next(c for c in fixture["cases"] if c["name"] == name)


def test_the_three_families_have_fixtures():
    models = {json.loads(p.read_text())["model"] for p in FIXTURES}
    assert models == {
        "GSAI-ML/LLaDA-8B-Instruct",
        "Dream-org/Dream-v0-Instruct-7B",
        "inclusionAI/LLaDA2.0-mini",
    }


@pytest.mark.parametrize("path,name", CASES, ids=[f"{p.stem}-{n}" for p, n in CASES])
def test_published_templates_render_as_transformers_rendered_them(path, name):
    fixture, case = fixture_case(path, name)
    assert ours(fixture, case) == fixture["renders"][name]


@pytest.mark.parametrize("path,name", CASES, ids=[f"{p.stem}-{n}" for p, n in CASES])
def test_published_templates_render_as_transformers_renders_them_now(path, name):
    pytest.importorskip("transformers")
    import render_with_transformers  # tests/fixtures/chat_templates/, on the path below

    fixture, case = fixture_case(path, name)
    assert ours(fixture, case) == render_with_transformers.render(fixture, case)


@pytest.fixture(autouse=True)
def fixture_scripts_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures" / "chat_templates"))


def one(text: str, **context) -> str:
    return render(compile_chat_template(text), [{"role": "user", "content": "x"}], **context)


def test_loop_controls():
    text = "{% for i in [1, 2, 3, 4] %}{% if i == 2 %}{% continue %}{% endif %}"
    text += "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert one(text) == "13"


def test_tojson_does_not_escape_and_takes_json_dumps_options():
    value = {"b": "<é & 'ü'>", "a": 1}
    assert one("{{ v | tojson }}", v=value) == '{"b": "<é & \'ü\'>", "a": 1}'
    assert one("{{ v | tojson(indent=1, sort_keys=true) }}", v=value) == json.dumps(
        value, indent=1, sort_keys=True, ensure_ascii=False
    )


def test_strftime_now_is_todays_date():
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = one("{{ strftime_now('%Y-%m-%d') }}")
    assert rendered in {before, datetime.now().strftime("%Y-%m-%d")}


def test_raise_exception_and_render_errors_are_value_errors():
    with pytest.raises(ValueError, match="chat template: roles must alternate"):
        one("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="chat template does not compile"):
        compile_chat_template("{% for m in messages %}")


def test_generation_blocks_render_their_text():
    assert one("a{% generation %}{{ messages[0].content }}{% endgeneration %}b") == "axb"


def test_special_tokens_by_name_in_either_form():
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "unk_token": None,
        "chat_template": "...",
        "model_max_length": 4096,
    }
    assert chat_template.special_tokens(config) == {"bos_token": "<s>", "eos_token": "</s>"}
    assert one("{{ bos_token }}|{{ eos_token }}", **chat_template.special_tokens(config)) == (
        "<s>|</s>"
    )
