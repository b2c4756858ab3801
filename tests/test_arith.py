from dilaserve.tasks import arith


def test_generation_is_deterministic_and_answers_are_right():
    a, b = arith.generate(50, seed=3), arith.generate(50, seed=3)
    assert a == b
    for p in a:
        assert arith.extract_answer(p.target) == p.answer
        value = None
        for step in p.solution.split(". ")[1:]:  # "x op n = y"
            lhs, rhs = step.rstrip(".").split(" = ")
            x, op, n = lhs.split()
            assert value is None or int(x) == value
            value = {"+": int(x) + int(n), "-": int(x) - int(n), "*": int(x) * int(n)}[op]
            assert value == int(rhs)
        assert value == p.answer


def test_train_and_test_splits_are_disjoint():
    train = {p.question for p in arith.generate(3000, seed=1, split="train")}
    test = {p.question for p in arith.generate(300, seed=1, split="test")}
    assert not train & test


def test_extract_answer():
    assert arith.extract_answer("so 3 + 4 = 7.\n#### 7") == 7
    assert arith.extract_answer("#### 1,234") == 1234
    assert arith.extract_answer("no answer here") is None


def test_narrow_problems_keep_every_value_small():
    for p in arith.generate(500, seed=2):
        values = [int(x) for x in p.solution.replace(".", " ").split() if x.isdigit()]
        assert max(values) <= arith.DIFFICULTIES["narrow"].max_value
    wide = arith.generate(500, seed=2, difficulty="wide")
    assert max(p.answer for p in wide) > arith.DIFFICULTIES["narrow"].max_value


def test_unknown_difficulty_is_named():
    import pytest

    with pytest.raises(ValueError, match="difficulty"):
        arith.generate(1, seed=0, difficulty="extreme")
