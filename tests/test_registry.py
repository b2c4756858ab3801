"""The model registry: config.json picks the family, its special ids, its cache semantics; bad
configs are refused by key; no code from the checkpoint folder ever runs."""

import json

import pytest
from family_checkpoints import (
    DREAM_SPECIALS,
    QWEN_TEMPLATE,
    dream_checkpoint,
    dream_config,
    llada2_checkpoint,
    llada2_config,
    write_tokenizer,
)

from dilaserve.config import EngineConfig
from dilaserve.engine.engine import Engine
from dilaserve.models import registry
from dilaserve.models.checkpoint import load_model
from dilaserve.models.tokenizer import Tokenizer
from dilaserve.protocol import KVCacheMode

VOCAB = {t: i for i, t in enumerate(DREAM_SPECIALS + ["<role>", "</role>", "<|role_end|>"])}


@pytest.fixture(scope="module")
def dream_path(tmp_path_factory):
    return dream_checkpoint(tmp_path_factory.mktemp("dream"))


@pytest.fixture(scope="module")
def llada2_path(tmp_path_factory):
    return llada2_checkpoint(tmp_path_factory.mktemp("llada2"))


def test_architectures_and_model_type_pick_the_family(tiny_checkpoint):
    assert registry.family_for(dream_config(VOCAB)).name == "Dream"
    assert registry.family_for(llada2_config(VOCAB)).name == "LLaDA2"
    assert registry.family_for({"model_type": "llada2_moe"}).name == "LLaDA2"
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    assert registry.family_for(raw).name == "LLaDA"
    with pytest.raises(ValueError, match="Qwen2ForCausalLM.*no supported model family"):
        registry.family_for({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})


@pytest.mark.parametrize(
    "make, key, value",
    [
        (dream_config, "rope_scaling", {"type": "yarn", "factor": 4.0}),
        (dream_config, "use_sliding_window", True),
        (dream_config, "hidden_act", "gelu"),
        (llada2_config, "score_function", "softmax"),
        (llada2_config, "norm_topk_prob", False),
        (llada2_config, "moe_router_enable_expert_bias", False),
        (llada2_config, "using_split_qkv_in_self_attention", True),
    ],
)
def test_a_computation_the_family_does_not_implement_is_refused_by_key(make, key, value):
    with pytest.raises(ValueError, match=f"config.json: {key}="):
        registry.config_from_dict(make(VOCAB, **{key: value}))


def test_inconsistent_shapes_are_refused_naming_the_keys():
    with pytest.raises(ValueError, match="rotary_dim"):
        registry.config_from_dict(llada2_config(VOCAB, rotary_dim=8))
    with pytest.raises(ValueError, match="n_group"):
        registry.config_from_dict(llada2_config(VOCAB, n_group=3))
    with pytest.raises(ValueError, match="missing required key.*num_key_value_heads"):
        raw = dream_config(VOCAB)
        del raw["num_key_value_heads"]
        registry.config_from_dict(raw)


def test_a_missing_or_broken_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        registry.load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        registry.load_config(tmp_path)


def test_special_ids_come_from_the_checkpoint(dream_path, llada2_path):
    dream = Tokenizer(dream_path)  # no config given: the folder's config.json names the family
    vocab = json.loads((dream_path / "tokenizer.json").read_text())["model"]["vocab"]
    raw = json.loads((dream_path / "config.json").read_text())
    assert dream.special.mask == raw["mask_token_id"] == vocab["<|mask|>"]
    assert dream.special.eos == raw["eos_token_id"]
    assert dream.special.eot == vocab["<|im_end|>"]
    assert dream.special.pad == raw["pad_token_id"]
    llada2 = Tokenizer(llada2_path, registry.load_config(llada2_path))
    vocab = json.loads((llada2_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert "mask_token_id" not in json.loads((llada2_path / "config.json").read_text())
    assert llada2.special.mask == vocab["<|mask|>"]  # LLaDA2.0's config has no mask id
    assert llada2.special.eos == vocab["<|endoftext|>"]  # tokenizer_config's eos_token
    assert llada2.special.eot == vocab["<|role_end|>"]


def test_each_family_renders_its_own_chat_template(dream_path):
    text = Tokenizer(dream_path).apply_chat_template([{"role": "user", "content": "w1 w2"}])
    assert text == "<|im_start|>user\nw1 w2<|im_end|>\n<|im_start|>assistant\n"


def test_the_family_resolves_the_cache_mode(dream_path, llada2_path):
    dream = Engine.from_checkpoint(dream_path, EngineConfig("dual"))
    assert dream.config.kv_cache is KVCacheMode.DUAL
    llada2 = Engine.from_checkpoint(llada2_path, EngineConfig("dual"))
    assert llada2.config.kv_cache is KVCacheMode.BLOCK  # its cache is exact
    assert Engine.from_checkpoint(llada2_path, EngineConfig("none")).config.kv_cache.value == "none"
    with pytest.raises(ValueError, match="kv_cache='block'.*bidirectionally"):
        Engine.from_checkpoint(dream_path, EngineConfig("block"))


def test_no_code_from_the_checkpoint_folder_runs(tmp_path):
    folder = dream_checkpoint(tmp_path / "dream")
    sentinel = tmp_path / "ran"
    for name in ("modeling_dream.py", "configuration_dream.py", "__init__.py"):
        (folder / name).write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    model = load_model(folder)
    Tokenizer(folder, model.config)
    assert type(model).__module__ == "dilaserve.models.dream"
    assert not sentinel.exists()


def test_a_checkpoint_missing_a_family_weight_names_it(tmp_path):
    folder = tmp_path / "dream"
    write_tokenizer(folder, DREAM_SPECIALS, QWEN_TEMPLATE)
    dream_checkpoint(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.self_attn.k_proj.bias"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing weight 'model.layers.1.self_attn.k_proj.bias'"):
        load_model(folder)


def test_a_chat_template_can_live_in_chat_template_jinja_or_a_named_list(tmp_path):
    folder = tmp_path / "tok"
    model_config = registry.config_from_dict(
        dream_config(write_tokenizer(folder, DREAM_SPECIALS, QWEN_TEMPLATE))
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    message = [{"role": "user", "content": "w1"}]
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(folder, model_config).apply_chat_template(message)
    (folder / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    text = Tokenizer(folder, model_config).apply_chat_template(message)
    assert text.startswith("<|im_start|>user\nw1")
    config["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(folder, model_config).apply_chat_template(message) == "w1!"


def test_a_template_that_raises_is_a_clear_error(tmp_path):
    folder = tmp_path / "tok"
    vocab = write_tokenizer(folder, DREAM_SPECIALS, "{{ raise_exception('roles alternate') }}")
    tokenizer = Tokenizer(folder, registry.config_from_dict(dream_config(vocab)))
    with pytest.raises(ValueError, match="chat template: roles alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "w1"}])


def test_a_hugging_face_id_is_told_to_download_first(tmp_path, monkeypatch, capsys):
    from dilaserve.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "GSAI-ML/LLaDA-8B-Instruct"]) == 2
    err = capsys.readouterr().err
    assert "looks like a Hugging Face model id" in err and "download it first" in err
    (tmp_path / "GSAI-ML" / "LLaDA-8B-Instruct").mkdir(parents=True)  # a folder of that name
    with pytest.raises(FileNotFoundError) as raised:
        registry.read_config_json("GSAI-ML/LLaDA-8B-Instruct")
    assert "Hugging Face" not in str(raised.value)
