"""LLaDA2's routed experts as one grouped matmul (models/moe.py): the same numbers as one expert
at a time, no host sync, and the checkpoint's per-expert names kept."""

import pytest
import torch

from dilaserve.models import moe
from dilaserve.models.layers import TPGroup
from dilaserve.models.llada2 import LLaDA2Config

torch.set_num_threads(1)


def config(**overrides) -> LLaDA2Config:
    raw = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=50,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        num_key_value_heads=2,
        head_dim=8,
        n_group=4,
        topk_group=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=64,
    )
    return LLaDA2Config.from_dict({**raw, **overrides})


def block(cfg, tp=TPGroup(), seed=0) -> moe.SparseMoeBlock:
    torch.manual_seed(seed)
    b = moe.SparseMoeBlock(cfg, tp)
    for p in b.parameters():
        p.data.normal_(0, 0.5)
    b.gate.expert_bias.uniform_(0, 0.2)
    return b


def one_expert_at_a_time(b: moe.SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The computation as the published block writes it: a loop over experts."""
    flat = x.reshape(-1, x.shape[-1])
    chosen, weights = b.gate(flat)
    routed = torch.zeros(flat.shape)
    bank = b.experts
    for e in bank.held:
        token, slot = (chosen == e).nonzero(as_tuple=True)
        if len(token):
            rows = flat[token]
            gate = rows @ bank.slot(f"{e}.gate_proj.weight").T
            up = rows @ bank.slot(f"{e}.up_proj.weight").T
            out = (torch.nn.functional.silu(gate) * up) @ bank.slot(f"{e}.down_proj.weight").T
            routed.index_add_(0, token, out * weights[token, slot][:, None])
    return routed.view(x.shape) + b.shared_experts(x)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_grouped_matmul_equals_one_expert_at_a_time(rank, monkeypatch):
    cfg = config()
    tp = TPGroup(2, rank) if rank else TPGroup()
    b = block(cfg, tp)
    if rank:  # one rank of two: its half of the experts, the all-reduce left out
        monkeypatch.setattr("torch.distributed.all_reduce", lambda t, group=None: None)
    x = torch.randn(3, 11, cfg.hidden_size)
    expected = one_expert_at_a_time(b, x)
    grouped = b(x)
    assert torch.allclose(grouped, expected, atol=1e-5, rtol=1e-5)
    if moe._grouped_mm_fits(x.reshape(-1, cfg.hidden_size), b.experts.gate_up):
        monkeypatch.setattr(moe, "_grouped_mm_fits", lambda *a: False)
        assert torch.equal(b(x), grouped)  # the per-expert fallback: the same bits


def test_the_grouped_path_needs_no_host_sync(monkeypatch):
    cfg = config()
    b = block(cfg)
    x = torch.randn(2, 9, cfg.hidden_size)
    if not moe._grouped_mm_fits(x.reshape(-1, cfg.hidden_size), b.experts.gate_up):
        pytest.skip(f"torch {torch.__version__} has no grouped matmul for these shapes")

    expected = one_expert_at_a_time(b, x)

    def synced(*args, **kwargs):
        raise AssertionError("a device-to-host copy")

    monkeypatch.setattr(torch.Tensor, "tolist", synced)
    monkeypatch.setattr(torch.Tensor, "item", synced)
    assert torch.allclose(b(x), expected, atol=1e-5, rtol=1e-5)


def test_unaligned_rows_fall_back_to_one_expert_at_a_time():
    cfg = config(hidden_size=30, num_attention_heads=2, num_key_value_heads=1, head_dim=15)
    b = block(cfg)
    x = torch.randn(2, 5, cfg.hidden_size)  # 120-byte rows: not a multiple of 16
    assert not moe._grouped_mm_fits(x.reshape(-1, 30), b.experts.gate_up)
    assert torch.allclose(b(x), one_expert_at_a_time(b, x), atol=1e-5)


def test_the_bank_keeps_the_checkpoint_names_per_expert():
    cfg = config()
    b = block(cfg, TPGroup(2, 1))
    state = b.experts.state_dict()
    assert sorted(state)[:3] == ["4.down_proj.weight", "4.gate_proj.weight", "4.up_proj.weight"]
    assert len(state) == 3 * 4 and state["5.down_proj.weight"].shape == (32, 16)
    fresh = moe.ExpertBank(4, 4, 32, 16)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.gate_up, b.experts.gate_up) and torch.equal(fresh.down, b.experts.down)
    with pytest.raises(KeyError, match="no expert weight '0.up_proj.weight' on this rank"):
        b.experts.slot("0.up_proj.weight")
