"""`dilaserve random-checkpoint FAMILY DIR`: a tiny random-weight checkpoint of every family the
registry knows, in the published file layout, that the package's own loader reads back."""

from __future__ import annotations

import pytest

from dilaserve.cli import main
from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.models.registry import FAMILIES, family_for, read_config_json
from dilaserve.training.random_checkpoint import WRITERS, write_random_checkpoint


def family_of_writer(name: str) -> str:
    """A writer is named by its family, or by a version of it (llada2.1: LLaDA2's)."""
    return name.split(".")[0]


def test_there_is_a_writer_for_every_registered_family():
    assert sorted({family_of_writer(w) for w in WRITERS}) == sorted(
        f.name.lower() for f in FAMILIES
    )


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_the_command_writes_a_checkpoint_the_engine_runs(family, tmp_path, capsys):
    folder = tmp_path / family
    assert main(["random-checkpoint", family, str(folder)]) == 0
    assert str(folder) in capsys.readouterr().out
    assert family_for(read_config_json(folder)).name.lower() == family_of_writer(family)
    assert any(folder.glob("*.safetensors")) and (folder / "tokenizer.json").is_file()
    llm = LLM(str(folder), EngineConfig(device="cpu"))
    (out,) = llm.generate(["1 + 2 ="], SamplingParams(threshold=0.9, max_tokens=32))
    assert out.num_steps >= 1 and len(out.token_ids) <= 32


def test_the_same_seed_writes_the_same_weights(tmp_path):
    a = write_random_checkpoint("dream", tmp_path / "a", seed=4)
    b = write_random_checkpoint("dream", tmp_path / "b", seed=4)
    for shard in sorted(a.glob("*.safetensors")):
        assert shard.read_bytes() == (b / shard.name).read_bytes()


def test_a_folder_with_files_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["random-checkpoint", "llada2", str(tmp_path)]) == 2
    assert f"{tmp_path} exists and is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_an_unknown_family_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="llada, dream, llada2"):
        write_random_checkpoint("gpt2", tmp_path / "x")
