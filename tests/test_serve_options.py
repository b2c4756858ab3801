"""`dilaserve serve` reaches every field of the configuration it builds: each field of
`ClusterConfig`, `WorkerConfig`, `EngineConfig`, `SchedulerConfig`, `ControlSpec`,
`ServerSettings` and `HttpLimits` has an option (whose default is the field's, unless said why
not here), or is named below as derived, and from what."""

import dataclasses
import json
import logging

import pytest

from dilaserve.cli import build_parser
from dilaserve.cli_args import apply_config_file, resolve_model
from dilaserve.cli_cluster import cluster_config
from dilaserve.cluster.config import ClusterConfig
from dilaserve.cluster.worker import WorkerConfig
from dilaserve.config import BUNDLED_CALIBRATION, EngineConfig
from dilaserve.control.build import ControlSpec
from dilaserve.control.decisions import SchedulerConfig
from dilaserve.server.app import ServerSettings
from dilaserve.server.limits import HttpLimits

CLASSES = (
    ClusterConfig,
    WorkerConfig,
    EngineConfig,
    SchedulerConfig,
    ControlSpec,
    ServerSettings,
    HttpLimits,
)
# fields no option sets, and what sets them
DERIVED = {
    "ClusterConfig.worker": "WorkerConfig from the model, engine and worker options",
    "ClusterConfig.control": "ControlSpec from the policy, calibration and scheduler options",
    "ClusterConfig.instances": "--layout, or --instances of --tp",
    "ClusterConfig.gpus_per_node": "None: the starting instances share one node",
    "ClusterConfig.replace_failed": "always on when serving (tests turn it off)",
    "ClusterConfig.record": "run-trace records its run (for --parity and --predict); serve not",
    "WorkerConfig.engine": "EngineConfig from the engine options",
    "EngineConfig.block_len": "DEFAULT_BLOCK_LEN, the block its calibration was measured at",
    "EngineConfig.early_finish": "on: a served request ends at its end-of-sequence token",
    "SchedulerConfig.block_len": "the engine's",
    "SchedulerConfig.refresh_every_tokens": "the step predictor's training (gbm-full.json)",
    "ControlSpec.profile": "the calibration's latency profile, or --profile",
    "ControlSpec.predictor": "the calibration's step predictor, or --predictor",
    "ControlSpec.scheduler": "SchedulerConfig from the scheduler options",
    "ServerSettings.address": "--host and --port",
    "ServerSettings.api_key": "--api-key-file or $DILASERVE_API_KEY (never an option's value)",
    "ServerSettings.http": "HttpLimits from the HTTP limit options",
    "ServerSettings.calibration": "what the control plane's inputs are (the calibration's label)",
}
# options whose name is not the field's
OPTION = {
    "WorkerConfig.model": "model",
    "WorkerConfig.nice": "worker_nice",
    "ControlSpec.nodes": "nodes",
    "SchedulerConfig.quality": "quality_curve",
    "ServerSettings.model_name": "served_model_name",
    "ServerSettings.allowed_hosts": "allowed_host",
}
# options whose default differs from their field's, and why
OWN_DEFAULT = {
    "ClusterConfig.max_tokens": "the checkpoint's generation_config.json max_new_tokens",
    "WorkerConfig.model": "MODEL or --model: the bundled model when neither is given",
    "WorkerConfig.threads": "one torch thread per rank, so that ranks do not oversubscribe",
    "SchedulerConfig.slo": "an interactive service's 1 s, not the library's 10 s",
    "ControlSpec.nodes": "the starting instances' total on one node",
    "SchedulerConfig.quality": "a file to read: the calibration's (eval --keep-curve), else none "
    "(the field's default, the paper's curve)",
    "ServerSettings.model_name": "the checkpoint folder's name",
    "ServerSettings.allowed_hosts": "the loopback names on a loopback --host, else any",
}


def serve_parser():
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices["serve"]


def field_names():
    return [f"{c.__name__}.{f.name}" for c in CLASSES for f in dataclasses.fields(c)]


def test_the_lists_name_only_real_fields():
    names = set(field_names())
    for table in (DERIVED, OPTION, OWN_DEFAULT):
        assert set(table) <= names


@pytest.mark.parametrize("name", field_names())
def test_every_field_has_an_option_or_is_derived(name):
    if name in DERIVED:
        return
    options = {a.dest: a for a in serve_parser()._actions}
    cls, field = name.split(".")
    dest = OPTION.get(name, field)
    assert dest in options, f"serve has no option for {name}"
    if name not in OWN_DEFAULT:
        by_name = {c.__name__: c for c in CLASSES}
        default = by_name[cls].__dataclass_fields__[field].default
        assert options[dest].default == default, f"--{dest} and {name} differ by default"


def test_new_options_reach_the_configuration():
    argv = ["serve", "--max-batch-tokens", "4096", "--max-requests-per-instance", "16"]
    argv += ["--refresh-interval", "0.2", "--migration-price", "0.05", "--start-timeout", "60"]
    argv += ["--load-control-interval", "0.1", "--tp-timeout", "30", "--max-forward-tokens", "512"]
    argv += ["--cuda-graph-context", "1024", "--admission-wait", "0.02"]
    args = build_parser().parse_args(argv)
    resolve_model(args)
    config, _ = cluster_config(args)
    scheduler, engine = config.control.scheduler, config.worker.engine
    assert (config.max_batch_tokens, config.start_timeout) == (4096, 60.0)
    assert (scheduler.max_requests_per_instance, scheduler.refresh_interval) == (16, 0.2)
    assert (scheduler.migration_price, scheduler.load_control_interval) == (0.05, 0.1)
    assert (config.worker.tp_timeout, engine.max_forward_tokens) == (30.0, 512)
    assert engine.cuda_graph_context == 1024
    assert config.admission_wait == 0.02
    args = build_parser().parse_args(["serve", "--quality-budget", "0.02"])
    resolve_model(args)
    assert cluster_config(args)[0].control.make_policy().quality_budget == 0.02


def test_a_live_quality_budget_needs_the_served_models_curve(tmp_path, caplog):
    """The live cluster keeps the policy's quality budget on the served model's own curve: the
    calibration's (`eval --keep-curve`; the bundled model ships one) or `--quality-curve`;
    without one it keeps none (the policy's would bind on a curve that is not the model's)."""
    args = build_parser().parse_args(["serve"])
    resolve_model(args)
    built, inputs = cluster_config(args)
    assert built.control.make_policy().quality_budget == 0.01
    assert built.control.scheduler.quality(0.9) == 0.836  # its eval at 0.9
    assert inputs.label["quality"] == str(BUNDLED_CALIBRATION / "quality.json")  # /v1/models
    given = ["--profile", str(BUNDLED_CALIBRATION / "profile.json")]
    given += ["--predictor", str(BUNDLED_CALIBRATION / "predictor")]
    args = build_parser().parse_args(["serve", *given])
    resolve_model(args)
    with caplog.at_level(logging.INFO, logger="dilaserve.calibration"):
        assert cluster_config(args)[0].control.make_policy().quality_budget is None
    assert "no quality curve" in caplog.text and "--keep-curve" in caplog.text
    curve = tmp_path / "summary.json"
    rows = [{"threshold": t, "accuracy": a} for t, a in ((0.7, 0.5), (0.8, 0.6), (0.9, 0.7))]
    curve.write_text(json.dumps({"table": rows}))
    args = build_parser().parse_args(["serve", *given, "--quality-curve", str(curve)])
    resolve_model(args)
    config = cluster_config(args)[0].control
    assert config.make_policy().quality_budget == 0.01
    assert config.scheduler.quality(0.9) == 0.7


def test_a_config_file_sets_serve_options(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('kv-cache = "none"\nslo = 2.5\nretry_after = 3\n')
    parser = build_parser()
    argv = ["serve", "--config", str(path), "--slo", "4"]
    args = apply_config_file(parser, parser.parse_args(argv), argv)
    assert (args.kv_cache, args.slo, args.retry_after) == ("none", 4.0, 3)


def test_code_builds_a_cluster_configuration_from_settings_not_argv():
    from dilaserve.cli_serving import run_trace_config

    config, inputs = run_trace_config(instances=1, slo=2.5, kv_cache="none", max_tokens=32)
    assert config.instances == (1,) and config.control.scheduler.slo == 2.5
    assert config.worker.engine.kv_cache.value == "none" and config.max_tokens == 32
    assert inputs.profile == config.control.profile
    with pytest.raises(ValueError, match=r"\['gpus'\] are not settings of `run-trace`"):
        run_trace_config(gpus=4)
