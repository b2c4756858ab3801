"""The model that ships inside the package: present, small, and able to do its task."""

from dilaserve.config import BUNDLED_MODEL, EngineConfig, SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.tasks import arith

MAX_WEIGHT_BYTES = 20 * 1024 * 1024


def test_bundled_checkpoint_is_complete_and_small():
    names = {p.name for p in BUNDLED_MODEL.iterdir()}
    assert {
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    weights = sum(p.stat().st_size for p in BUNDLED_MODEL.glob("*.safetensors"))
    assert 0 < weights <= MAX_WEIGHT_BYTES


def test_bundled_model_solves_held_out_problems_and_lower_threshold_takes_fewer_steps():
    llm = LLM(BUNDLED_MODEL, EngineConfig(kv_cache="dual"))
    problems = arith.generate(16, seed=11, split="test")
    questions = [p.question for p in problems]
    strict = llm.generate(questions, SamplingParams(threshold=0.9))
    loose = llm.generate(questions, SamplingParams(threshold=0.5))
    correct = sum(arith.extract_answer(o.text) == p.answer for o, p in zip(strict, problems))
    assert correct >= 12
    assert sum(o.num_steps for o in loose) < sum(o.num_steps for o in strict)
