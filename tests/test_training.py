import pytest
import torch

from dilaserve.models.checkpoint import load_model
from dilaserve.models.tokenizer import Tokenizer
from dilaserve.training.train_model import TrainConfig, _mask_response, train

SMALL = dict(
    max_steps=2,
    batch_size=4,
    d_model=32,
    n_heads=2,
    n_layers=1,
    mlp_hidden_size=64,
    vocab_size=200,
    threads=1,  # train() sets torch's threads for the process: keep the tests' one
)


def test_block_structured_masks_keep_earlier_blocks_and_hide_later_ones():
    cfg = TrainConfig(out="unused", gen_len=64, block_len=32, block_mask_fraction=1.0)
    _, masked = _mask_response(torch.Generator().manual_seed(0), 200, cfg)
    first, second = masked[:, :32], masked[:, 32:]
    # working on block 0: block 1 fully masked; working on block 1: block 0 fully clean
    assert all(s.all() or not f.any() for f, s in zip(first, second))


@pytest.mark.slow
def test_a_short_training_run_writes_a_loadable_checkpoint(tmp_path):
    folder = train(TrainConfig(out=str(tmp_path / "m"), num_shards=2, **SMALL))
    model = load_model(folder)
    tok = Tokenizer(folder, model.config)
    assert model.config.vocab_size == tok.vocab_size
    assert tok.special.mask == model.config.mask_token_id
    assert (folder / "training_log.json").exists()
    assert len(list(folder.glob("model-*.safetensors"))) == 2


@pytest.mark.slow
def test_training_can_continue_from_a_checkpoint(tmp_path):
    first = train(TrainConfig(out=str(tmp_path / "a"), **SMALL))
    second = train(TrainConfig(out=str(tmp_path / "b"), init_from=str(first), **SMALL))
    a, b = load_model(first), load_model(second)
    assert (second / "tokenizer.json").read_text() == (first / "tokenizer.json").read_text()
    wte = "model.transformer.wte.weight"
    assert not torch.equal(dict(a.named_parameters())[wte], dict(b.named_parameters())[wte])
