import pytest

from dilaserve.config import EngineConfig, SamplingParams
from dilaserve.protocol import KVCacheMode, StepKind
from dilaserve.request import next_step_kind


def test_max_tokens_rounds_up_to_whole_blocks():
    assert SamplingParams(max_tokens=1).gen_len(32) == 32
    assert SamplingParams(max_tokens=64).gen_len(32) == 64
    assert SamplingParams(max_tokens=65).gen_len(32) == 96


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"threshold": 0.0}, "threshold"),
        ({"threshold": 1.01}, "threshold"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_config_validates_and_coerces():
    assert EngineConfig(kv_cache="prefix").kv_cache is KVCacheMode.PREFIX
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int4")
    with pytest.raises(ValueError, match="block_len"):
        EngineConfig(block_len=0)
    with pytest.raises(ValueError):
        EngineConfig(kv_cache="paged")


@pytest.mark.parametrize("budget", [0, 3, 16])
def test_a_step_budget_must_divide_the_block(budget):
    assert EngineConfig(block_len=8, step_budget=4).step_budget == 4
    with pytest.raises(ValueError, match="step_budget"):
        EngineConfig(block_len=8, step_budget=budget)


def test_next_step_kind():
    assert next_step_kind(KVCacheMode.NONE, True, True) is StepKind.FULL
    assert next_step_kind(KVCacheMode.DUAL, True, True) is StepKind.RECOMPUTE
    assert next_step_kind(KVCacheMode.DUAL, False, False) is StepKind.RECOMPUTE
    assert next_step_kind(KVCacheMode.PREFIX, False, True) is StepKind.CACHE
