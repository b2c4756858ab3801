"""Block-diffusion training of the LLaDA2 family: the two-copy batch sees exactly what block-causal
inference sees, a block's loss ignores later blocks, and `train-model --arch llada2` writes a
checkpoint that loads as the LLaDA2 family and generates."""

import pytest
import torch
import torch.nn.functional as F

from dilaserve.cli import main
from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.models.checkpoint import load_model
from dilaserve.models.registry import family_of
from dilaserve.training import block_diffusion
from dilaserve.training.train_model import TrainConfig, train

BLOCK, GEN, MASK = 8, 16, 4
TINY = dict(d_model=32, n_heads=4, n_layers=2, mlp_hidden_size=64, moe_hidden_size=16)


def tiny_model():
    cfg = TrainConfig(out="unused", arch="llada2", block_len=BLOCK, gen_len=GEN, **TINY)
    model = block_diffusion.create_llada2(cfg, vocab_size=40, mask_id=MASK, eos_id=0)
    return model.eval()


def pairs(later_answer_token: int = 7):
    """Two rows (prompt lengths 13 and 8): answers whose positions past 24 hold a given token."""
    rows = []
    for n in (13, 8):
        prompt = [10 + i % 20 for i in range(n)]
        answer = [5 + (i * 3) % 30 if n + i < 24 else later_answer_token for i in range(GEN)]
        rows.append((prompt, answer))
    return rows


def batch(rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return block_diffusion.make_block_batch(rows, GEN, BLOCK, MASK, gen)


def per_position_losses(model, b) -> torch.Tensor:
    logits = block_diffusion.masked_logits(model, b, BLOCK)
    return F.cross_entropy(logits, b.targets[b.is_masked], reduction="none")


def inference_logits(model, b, row: int, block: int) -> torch.Tensor:
    """Block-causal inference on the row's clean copy, `block` as the noisy copy has it and
    later blocks masked: logits of that block's masked positions."""
    clean = ~b.is_noisy[row] & b.valid[row]
    ids, positions = b.ids[row, clean].clone(), b.positions[row, clean]
    noisy = b.is_noisy[row] & b.valid[row] & (b.positions[row] // BLOCK == block)
    ids[b.positions[row, noisy]] = b.ids[row, noisy]
    ids[positions // BLOCK > block] = MASK
    valid = torch.ones_like(ids[None], dtype=torch.bool)
    hidden = model(ids[None], positions[None], valid, block_len=BLOCK)
    wanted = b.positions[row, noisy][b.is_masked[row, noisy]]
    return model.logits(hidden.hidden[0, wanted])


def test_two_copy_batch_matches_block_causal_inference():
    model, b = tiny_model(), batch(pairs())
    with torch.no_grad():
        trained = block_diffusion.masked_logits(model, b, BLOCK)
        rows = b.is_masked.nonzero()[:, 0]
        blocks = b.positions[b.is_masked] // BLOCK
        checked = 0
        for row, block in sorted({(int(r), int(k)) for r, k in zip(rows, blocks)}):
            here = (rows == row) & (blocks == block)
            torch.testing.assert_close(trained[here], inference_logits(model, b, row, block))
            checked += 1
    assert checked >= 4  # both rows, several blocks each


def test_a_blocks_loss_ignores_later_blocks():
    model = tiny_model()
    first, second = batch(pairs(7)), batch(pairs(9))
    assert torch.equal(first.is_masked, second.is_masked)
    early = (first.positions[first.is_masked] // BLOCK) < 24 // BLOCK
    with torch.no_grad():
        a, b = per_position_losses(model, first), per_position_losses(model, second)
    torch.testing.assert_close(a[early], b[early])
    assert not torch.allclose(a[~early], b[~early])  # the later block's own loss does change


def test_noisy_copy_masks_answers_only():
    b = batch(pairs())
    answer_starts = torch.tensor([13, 8])
    masked_positions = torch.where(b.is_masked, b.positions, 10**6).min(dim=1).values
    assert (masked_positions >= answer_starts).all()
    assert (b.ids[b.is_masked] == MASK).all()
    assert not b.is_masked[~b.is_noisy].any()


@pytest.mark.slow
def test_train_model_llada2_writes_a_generating_llada2_checkpoint(tmp_path):
    small = dict(max_steps=2, batch_size=4, vocab_size=200, threads=1, **TINY)
    folder = train(TrainConfig(out=str(tmp_path / "m"), arch="llada2", **small))
    model = load_model(folder)
    assert family_of(model.config).name == "LLaDA2"
    assert model.config.extra["block_len"] == 32
    llm = LLM(folder, EngineConfig("block", 32))
    [out] = llm.generate(["Ann has 3 eggs."], SamplingParams(threshold=0.9, max_tokens=32))
    assert out.num_steps >= 1 and len(out.token_ids) <= 32
    assert llm.engine.config.kv_cache.value == "block"


def test_cli_train_model_takes_the_arch(monkeypatch):
    seen = {}
    monkeypatch.setattr(
        "dilaserve.training.train_model.train", lambda cfg: seen.setdefault("c", cfg)
    )
    main(["train-model", "--arch", "llada2", "--out", "x", "--max-steps", "1"])
    assert seen["c"].arch == "llada2"


def test_continuing_a_checkpoint_of_another_family_is_refused(tiny_checkpoint, tmp_path):
    # a random LLaDA checkpoint: the family is read before any training step
    small = dict(max_steps=1, batch_size=2, vocab_size=200, threads=1, **TINY)
    cfg = TrainConfig(
        out=str(tmp_path / "b"), arch="llada2", init_from=str(tiny_checkpoint), **small
    )
    with pytest.raises(ValueError, match="is a LLaDA checkpoint, not cfg.arch='llada2'"):
        train(cfg)
    assert not (tmp_path / "b").exists()
