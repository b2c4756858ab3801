"""Carrying out a reconfiguration: which launches load together and what stays serving."""

from dilaserve.control.decisions import Decisions, InstanceSpec, Reconfiguration, RolloutStep
from dilaserve.control.rollout import Rollout


class IdleScheduler:
    """The scheduler calls a rollout makes, for instances that are always between steps."""

    def __init__(self, *instances: str):
        self.instances = dict.fromkeys(instances)

    def add_instance(self, instance_id, tp, limit, node, gpus):
        self.instances[instance_id] = tp

    def drain_instance(self, instance_id, now):
        return Decisions()

    def is_idle(self, instance_id):
        return True

    def remove_instance(self, instance_id, now):
        del self.instances[instance_id]
        return Decisions()

    def on_tick(self, now):
        return Decisions()


class Driver:
    def __init__(self):
        self.loading: list[str] = []

    def apply(self, decisions, now, event):
        pass

    def start_instance(self, spec, now):
        self.loading.append(spec.instance_id)

    def instance_added(self, spec, now):
        pass

    def instance_removed(self, instance_id, now):
        pass


def tp1(name: str, gpu: int) -> InstanceSpec:
    return InstanceSpec(name, 0, 1, (gpu,))


def tp4_to_four_tp1(serial: bool) -> Reconfiguration:
    specs = [tp1(f"n{g}", g) for g in range(4)]
    steps = [RolloutStep(("old",), specs[0])] + [RolloutStep((), s) for s in specs[1:]]
    return Reconfiguration(tuple(steps), (), {1: 4}, serial)


def test_instances_whose_gpus_are_free_load_together():
    scheduler, driver = IdleScheduler("old"), Driver()
    rollout = Rollout(scheduler, driver, 4096)
    rollout.begin(tp4_to_four_tp1(serial=False), 0.0)
    assert driver.loading == ["n0", "n1", "n2", "n3"] and "old" not in scheduler.instances
    for name in ("n0", "n1", "n2", "n3"):
        rollout.on_up(tp1(name, int(name[1])), 7.5)
    assert not rollout.active and sorted(scheduler.instances) == ["n0", "n1", "n2", "n3"]


def test_serial_launches_wait_for_each_other():
    scheduler, driver = IdleScheduler("old"), Driver()
    rollout = Rollout(scheduler, driver, 4096)
    rollout.begin(tp4_to_four_tp1(serial=True), 0.0)
    assert driver.loading == ["n0"]
    rollout.on_up(tp1("n0", 0), 7.5)
    assert driver.loading == ["n0", "n1"]


def test_nothing_more_is_stopped_while_a_launch_is_loading():
    scheduler, driver = IdleScheduler("a", "b"), Driver()
    rollout = Rollout(scheduler, driver, 4096)
    steps = (RolloutStep(("a",), tp1("x", 0)), RolloutStep(("b",), tp1("y", 1)))
    rollout.begin(Reconfiguration(steps, (), {1: 2}), 0.0)
    assert driver.loading == ["x"] and "b" in scheduler.instances  # b serves while x loads
    rollout.on_up(tp1("x", 0), 7.5)
    assert driver.loading == ["x", "y"] and "b" not in scheduler.instances


def test_retired_instances_stop_once_every_launch_is_up():
    scheduler, driver = IdleScheduler("a", "spare"), Driver()
    rollout = Rollout(scheduler, driver, 4096)
    rollout.begin(Reconfiguration((RolloutStep((), tp1("x", 3)),), ("spare",), {1: 2}), 0.0)
    assert "spare" in scheduler.instances
    rollout.on_up(tp1("x", 3), 7.5)
    assert "spare" not in scheduler.instances and not rollout.active


class LimitedScheduler(IdleScheduler):
    def __init__(self, *instances: str):
        super().__init__(*instances)
        self.limits = None

    def set_batch_limits(self, limits):
        self.limits = limits


def test_a_plan_of_batch_limits_alone_sets_them_and_moves_nothing():
    scheduler, driver = LimitedScheduler("old"), Driver()
    rollout = Rollout(scheduler, driver, 4096)
    limits = {1: (2048, 512)}
    assert not rollout.begin(Reconfiguration((), (), {1: 1}, batch_limits=limits), 0.0)
    assert scheduler.limits == limits and not rollout.active and rollout.log == []
    assert rollout.begin(tp4_to_four_tp1(serial=False), 1.0)  # no limits: left as they were
    assert scheduler.limits == limits
