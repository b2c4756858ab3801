import pytest

from dilaserve.cluster.config import ClusterConfig
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.config import EngineConfig


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="instances"):
        ClusterConfig(instances=())
    with pytest.raises(ValueError, match="backend"):
        ClusterConfig(backend="slurm")
    with pytest.raises(ValueError, match="tick"):
        ClusterConfig(tick=0)
    with pytest.raises(ValueError, match="engine block_len=16 differs from the scheduler's 32"):
        ClusterConfig(worker=WorkerConfig(engine=EngineConfig(block_len=16)))


def test_instances_fill_nodes_in_order():
    specs = ClusterConfig(instances=(2, 1, 4, 1), gpus_per_node=4).initial_specs()
    assert [(s.instance_id, s.node, s.tp, s.gpus) for s in specs] == [
        ("i0", 0, 2, (0, 1)),
        ("i1", 0, 1, (2,)),
        ("i2", 1, 4, (0, 1, 2, 3)),
        ("i3", 2, 1, (0,)),
    ]


def test_no_dws_estimator_unless_named():
    assert ClusterConfig().dws_estimator() is None


@pytest.mark.parametrize("flag", [False, True])
def test_serve_passes_the_plan_batch_limits_to_the_planner(flag):
    from dilaserve.cli import build_parser
    from dilaserve.cli_args import resolve_model
    from dilaserve.cli_cluster import cluster_config
    from dilaserve.control.build import build_scheduler

    argv = ["serve", "--nodes", "2"] + (["--plan-batch-limits"] if flag else [])
    args = build_parser().parse_args(argv)
    resolve_model(args)
    config, _ = cluster_config(args)
    assert config.control.plan_batch_limits is flag
    assert build_scheduler(config.control).reconfigurer.config.batch_limits is flag
