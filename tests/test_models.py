import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dilaserve.models.checkpoint import INDEX_FILE, CheckpointError, load_model
from dilaserve.models.config import LLaDAConfig
from dilaserve.models.layers import (
    ColumnParallelLinear,
    MergedColumnLinear,
    RMSNorm,
    Rotary,
    RowParallelLinear,
    TPGroup,
)
from dilaserve.models.tokenizer import Tokenizer

LLADA_8B_KEYS = (  # the published layout's names for layer 0 and the top level
    "model.transformer.wte.weight",
    "model.transformer.ln_f.weight",
    "model.transformer.ff_out.weight",
    "model.transformer.blocks.0.attn_norm.weight",
    "model.transformer.blocks.0.q_proj.weight",
    "model.transformer.blocks.0.k_proj.weight",
    "model.transformer.blocks.0.v_proj.weight",
    "model.transformer.blocks.0.attn_out.weight",
    "model.transformer.blocks.0.ff_norm.weight",
    "model.transformer.blocks.0.ff_proj.weight",
    "model.transformer.blocks.0.up_proj.weight",
    "model.transformer.blocks.0.ff_out.weight",
)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_uses_the_published_layout(tiny_checkpoint):
    index = json.loads((tiny_checkpoint / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert set(LLADA_8B_KEYS) <= set(index["weight_map"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loads_with_expected_shapes_and_dtype(tiny_checkpoint, dtype):
    model = load_model(tiny_checkpoint, dtype)
    cfg = model.config
    params = model.state_dict()  # the checkpoint's names (merged projections' parts too)
    assert params["model.transformer.wte.weight"].shape == (cfg.padded_vocab_size, cfg.d_model)
    assert params["model.transformer.blocks.1.k_proj.weight"].shape == (
        cfg.num_kv_heads * cfg.head_dim,
        cfg.d_model,
    )
    assert params["model.transformer.blocks.0.ff_out.weight"].shape == (
        cfg.d_model,
        cfg.mlp_hidden_size,
    )
    assert all(p.dtype == dtype for p in params.values())
    ids = torch.tensor([[3, 4, 5, cfg.mask_token_id]])
    out = model(ids, torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool))
    logits = model.logits(out.hidden)
    assert logits.shape == (1, 4, cfg.vocab_size)  # padded embedding rows are cut off
    assert torch.isfinite(logits.float()).all()


def test_loaded_weights_match_the_files(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    shard = sorted(tiny_checkpoint.glob("model-*.safetensors"))[0]
    for key, tensor in load_file(str(shard)).items():
        assert torch.equal(model.state_dict()[key], tensor)


def _rewrite_shard(folder, edit):
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    return tensors


def test_missing_key_is_named(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    index = json.loads((folder / INDEX_FILE).read_text())
    del index["weight_map"]["model.transformer.blocks.1.q_proj.weight"]
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing weight 'model.transformer.blocks.1.q_proj"):
        load_model(folder)


def test_unexpected_key_is_named(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["model.transformer.blocks.0.q_norm.weight"] = "x.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match="unexpected weight 'model.transformer.blocks.0.q_norm"
    ):
        load_model(folder)


def test_wrong_shape_is_named(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    key = {}

    def shrink(tensors):
        key["name"] = name = sorted(tensors)[0]
        tensors[name] = tensors[name][:1].clone()

    _rewrite_shard(folder, shrink)
    with pytest.raises(CheckpointError, match=f"weight '{key['name']}' has shape"):
        load_model(folder)


def test_missing_folder_config_and_shard_are_clear(tiny_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    folder = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    sorted(folder.glob("model-*.safetensors"))[1].unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors"):
        load_model(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(folder)


def test_unusable_device_is_a_clear_error(tiny_checkpoint):
    with pytest.raises(ValueError, match="'gpu' is not a torch device"):
        load_model(tiny_checkpoint, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda'.*sees no CUDA GPU"):
            load_model(tiny_checkpoint, device="cuda")


def test_loading_a_checkpoint_leaves_torch_dynamo_unimported():
    """A replacement worker loads while the others serve: building the model on the meta device
    once took torch's reference path for the rotary frequencies, importing torch._dynamo (1.7 s
    of CPU, most of a worker's load). A fresh process, since this one may have imported it."""
    families = ("tiny-llada", "tiny-llada2")
    code = (
        "import sys; from dilaserve.models.checkpoint import load_model; "
        "from dilaserve.config import ASSETS; "
        f"[load_model(ASSETS / name) for name in {families!r}]; "
        "print('torch._dynamo' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="missing required key.*n_layers"):
        LLaDAConfig.from_dict({"d_model": 8, "n_heads": 2, "mlp_hidden_size": 8, "vocab_size": 9})
    with pytest.raises(ValueError, match="d_model"):
        LLaDAConfig.from_dict(
            {"d_model": 9, "n_heads": 2, "n_layers": 1, "mlp_hidden_size": 8, "vocab_size": 9}
        )


def test_tokenizer_reads_special_ids_and_chat_template(tiny_checkpoint, tiny_tokenizer):
    special = tiny_tokenizer.special
    assert special.mask == tiny_tokenizer._tok.token_to_id("<|mdm_mask|>")
    assert special.eos == json.loads((tiny_checkpoint / "config.json").read_text())["eos_token_id"]
    assert special.eot == tiny_tokenizer._tok.token_to_id("<|eot_id|>")
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": " Hi 12 "}])
    assert text == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi 12<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tiny_tokenizer.encode("Tom has 12 apples.")
    assert tiny_tokenizer.decode(ids) == "Tom has 12 apples."
    pieces = [tiny_tokenizer._tok.id_to_token(i) for i in tiny_tokenizer.encode("x 1234")]
    assert pieces[-4:] == ["1", "2", "3", "4"]  # one token per digit


def test_tokenizer_without_files_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_parallel_linears_take_their_shard_and_sum_to_the_full_product():
    torch.manual_seed(0)
    full_col, full_row = torch.randn(6, 4), torch.randn(4, 6)
    x = torch.randn(3, 4)
    col_parts, row_parts = [], []
    for rank in range(2):
        col = ColumnParallelLinear(4, 6, TPGroup(size=2, rank=rank))
        col.load_full(full_col)
        col_parts.append(col(x))
        row = RowParallelLinear(6, 4, TPGroup(size=2, rank=rank))
        row.load_full(full_row)
        row_parts.append(row.weight @ torch.ones(3))
    assert torch.allclose(torch.cat(col_parts, dim=-1), x @ full_col.T)
    assert col_parts[0].shape == (3, 3)
    assert torch.allclose(sum(row_parts), full_row @ torch.ones(6))
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 4"):
        ColumnParallelLinear(4, 6, TPGroup(size=4, rank=0))


def test_merged_projections_are_the_separate_ones_and_keep_their_names():
    """Equal within rounding here (a 4-wide matmul may sum in another order); to the bit on
    the bundled models (tests/test_dataplane.py)."""
    torch.manual_seed(0)
    full = {"q_proj": torch.randn(8, 4), "k_proj": torch.randn(4, 4), "v_proj": torch.randn(4, 4)}
    bias = {name: torch.randn(len(w)) for name, w in full.items()}
    x = torch.randn(3, 5, 4)
    for rank in range(2):
        tp = TPGroup(size=2, rank=rank)
        merged = MergedColumnLinear(4, {n: len(w) for n, w in full.items()}, tp, bias=True)
        for name in full:
            merged.load_full(full[name], f"{name}.weight")
            merged.load_full(bias[name], f"{name}.bias")
        for name, out in zip(full, merged.split(merged(x))):
            alone = ColumnParallelLinear(4, len(full[name]), tp, bias=True)
            alone.load_full(full[name])
            alone.load_full(bias[name], "bias")
            assert torch.allclose(out, alone(x), atol=1e-6, rtol=0)
    block = torch.nn.Module()
    block.qkv = merged
    state = block.state_dict()
    assert list(state) == [f"{n}.{p}" for n in full for p in ("weight", "bias")]
    assert torch.equal(state["k_proj.weight"], full["k_proj"][2:])  # rank 1's half
    with pytest.raises(KeyError, match="no projection weight 'o_proj.weight'"):
        merged.slot("o_proj.weight")


def test_norm_and_rotary_in_fewer_kernels_are_the_published_formulas_to_the_bit():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 16)
    norm = RMSNorm(16, 1e-6)
    norm.weight.data.normal_()
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.equal(norm(x), want)
    rotary = Rotary(16, 10000.0, rotary_dim=8)
    positions = torch.arange(7).expand(2, 7)
    angles = positions.float()[:, None, :, None] * rotary.inv_freq
    cos, sin = angles.cos(), angles.sin()
    x1, x2, rest = x[..., :4], x[..., 4:8], x[..., 8:]
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    assert torch.equal(Rotary.rotate(x, *rotary.angles(positions)), want)
