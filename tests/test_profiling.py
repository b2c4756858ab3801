import json

from dilaserve.cli import main
from dilaserve.control.profile import LatencyProfile
from dilaserve.protocol import StepKind


def test_profile_command_writes_a_loadable_profile(tiny_checkpoint, tmp_path):
    target = tmp_path / "p.json"
    args = [
        "profile",
        "--model",
        str(tiny_checkpoint),
        "--seq-len",
        "48",
        "--gen-len",
        "32",
        "--requests",
        "1,3",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
        "--profile-out",
        str(target),
    ]
    assert main(args) == 0
    profile = LatencyProfile.from_file(target)
    assert profile.curve(1, StepKind.RECOMPUTE).tokens == (48, 144)
    assert profile.curve(1, StepKind.CACHE).tokens == (32, 96)  # one block per request
    assert all(s > 0 for s in profile.curve(1, StepKind.CACHE).seconds)
    assert "torch" in json.loads(target.read_text())["versions"]
    assert list(tmp_path.glob("profile-*/records.csv"))
