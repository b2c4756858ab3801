import torch

from dilaserve.engine.unmask import select_unmask


def test_commits_every_candidate_above_its_rows_threshold():
    conf = torch.tensor([[0.95, 0.5, 0.92, 0.3], [0.95, 0.5, 0.92, 0.3]])
    candidates = torch.ones(2, 4, dtype=torch.bool)
    commit = select_unmask(conf, candidates, torch.tensor([0.9, 0.4]))
    assert commit.tolist() == [[True, False, True, False], [True, True, True, False]]


def test_falls_back_to_the_single_most_confident_candidate():
    conf = torch.tensor([[0.2, 0.6, 0.4]])
    commit = select_unmask(conf, torch.ones(1, 3, dtype=torch.bool), torch.tensor([0.9]))
    assert commit.tolist() == [[False, True, False]]


def test_fallback_ignores_non_candidates():
    conf = torch.tensor([[0.8, 0.6, 0.4]])
    candidates = torch.tensor([[False, False, True]])
    commit = select_unmask(conf, candidates, torch.tensor([0.9]))
    assert commit.tolist() == [[False, False, True]]


def test_threshold_one_commits_exactly_one_token_per_step():
    conf = torch.tensor([[1.0, 0.99, 0.999]])
    commit = select_unmask(conf, torch.ones(1, 3, dtype=torch.bool), torch.tensor([1.0]))
    assert commit.sum().item() == 1 and commit[0, 0]


def test_row_without_candidates_commits_nothing():
    conf = torch.tensor([[0.99, 0.99]])
    commit = select_unmask(conf, torch.zeros(1, 2, dtype=torch.bool), torch.tensor([0.5]))
    assert not commit.any()


def test_never_commits_a_non_candidate_even_if_confident():
    conf = torch.tensor([[0.99, 0.1]])
    commit = select_unmask(conf, torch.tensor([[False, True]]), torch.tensor([0.5]))
    assert commit.tolist() == [[False, True]]


def test_a_row_short_of_its_minimum_commits_its_most_confident_candidates():
    conf = torch.tensor([[0.2, 0.6, 0.4, 0.95], [0.2, 0.6, 0.4, 0.95], [0.2, 0.6, 0.4, 0.3]])
    candidates = torch.tensor([[True] * 4, [True] * 4, [True, False, True, True]])
    mins = torch.tensor([3, 1, 5])
    commit = select_unmask(conf, candidates, torch.tensor([0.9, 0.5, 0.9]), mins)
    assert commit.tolist() == [
        [False, True, True, True],  # only 0.95 clears 0.9: the top 3 instead
        [False, True, False, True],  # two clear 0.5, more than its minimum of 1
        [True, False, True, True],  # a minimum past its candidates takes them all
    ]


def test_ties_go_to_the_earlier_position():
    conf = torch.tensor([[0.3, 0.5, 0.5, 0.5]])
    commit = select_unmask(
        conf, torch.ones(1, 4, dtype=torch.bool), torch.tensor([0.9]), torch.tensor([2])
    )
    assert commit.tolist() == [[False, True, True, False]]


def test_a_cap_keeps_the_most_confident_commits_and_never_drops_the_minimum():
    conf = torch.tensor([[0.95, 0.2, 0.97, 0.96], [0.95, 0.2, 0.97, 0.96], [0.1, 0.2, 0.3, 0.4]])
    candidates = torch.ones(3, 4, dtype=torch.bool)
    caps = torch.tensor([2, 4, 3])
    commit = select_unmask(conf, candidates, torch.tensor([0.9, 0.9, 0.9]), None, caps)
    assert commit.tolist() == [
        [False, False, True, True],  # three clear 0.9; the cap keeps the best two
        [True, False, True, True],  # under its cap: all that clear
        [False, False, False, True],  # none clears: the top-1 still
    ]
