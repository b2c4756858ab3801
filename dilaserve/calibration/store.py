"""Where calibrations live, what they are keyed by, and which one a served model gets.

A calibration is a folder of one model's control inputs, measured on one device in one dtype:

    calibration.json   the key (model name, sha256 of config.json, device name, dtype), the TP
                       degrees measured, versions, the command, warnings from the measurement
    profile.json       the latency profile (`control/profile.py`) at every measured TP degree
    predictor/         the step predictor trained on the model's own trajectories
    dws-cost.json      the DWS cost kernel (`calibrate --dws`), where DWS is used
    quality.json       the model's accuracy per threshold (`eval --keep-curve`): the quality
                       budget is kept on it (`control/quality_budget.py`)
    records.csv, summary.json, report.md, config.json: the run that made it

It lives next to the model (`MODEL/dilaserve-calibration/<device>-<dtype>/`) when that folder is
writable, else under the cache (`$DILASERVE_CACHE`, default `~/.cache/dilaserve`); `--calibration
DIR` names one directly. The device name is what torch reports for a GPU ("NVIDIA H200"), and
"cpu" for any CPU (the processor is recorded, and a different one is warned about).

`resolve_control_inputs` picks what `serve` and `run-trace` drive the control plane with: an
explicit profile (a file, or a preset by name) and predictor, else the matching calibration,
else it refuses with the command that would make one. No torch here: the device name is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dilaserve.models.folder import no_config_error

CALIBRATION_FILE = "calibration.json"
PROFILE_FILE = "profile.json"
PREDICTOR_DIR = "predictor"
DWS_COST_FILE = "dws-cost.json"
QUALITY_FILE = "quality.json"
FOLDER_NAME = "dilaserve-calibration"
SCHEMA = 1


class CalibrationMissing(ValueError):
    """No calibration matches the model, device, dtype and TP degrees asked for."""


@dataclass(frozen=True, slots=True)
class CalibrationKey:
    """What a calibration was measured on. Two keys match when every field is equal."""

    model: str  # the checkpoint folder's name, for messages
    config_sha256: str
    device: str  # "NVIDIA H200", or "cpu"
    dtype: str

    def describe(self, tps=()) -> str:
        tp = f" tp={','.join(map(str, sorted(tps)))}" if tps else ""
        return f"{self.model} on {self.device} {self.dtype}{tp}"

    def matches(self, other: CalibrationKey) -> bool:
        return (self.config_sha256, self.device, self.dtype) == (
            other.config_sha256,
            other.device,
            other.dtype,
        )


@dataclass(frozen=True, slots=True)
class Calibration:
    folder: Path
    key: CalibrationKey
    tp_degrees: tuple[int, ...]
    processor: str = ""
    warnings: tuple[str, ...] = ()

    @property
    def profile(self) -> Path:
        return self.folder / PROFILE_FILE

    @property
    def predictor(self) -> Path:
        return self.folder / PREDICTOR_DIR

    @property
    def dws_cost(self) -> Path | None:
        """The DWS cost kernel, where `calibrate --dws` fitted one."""
        path = self.folder / DWS_COST_FILE
        return path if path.is_file() else None

    @property
    def quality(self) -> Path | None:
        """The model's quality curve, where `eval --keep-curve` measured one."""
        path = self.folder / QUALITY_FILE
        return path if path.is_file() else None

    def label(self) -> dict:
        """What `/v1/models` and the logs say about the control plane's inputs."""
        return {
            "source": "calibrated",
            "folder": str(self.folder),
            "model": self.key.model,
            "device": self.key.device,
            "dtype": self.key.dtype,
            "tp": list(self.tp_degrees),
        } | ({"quality": str(self.quality)} if self.quality else {})

    @classmethod
    def load(cls, folder: str | Path) -> Calibration:
        folder = Path(folder)
        path = folder / CALIBRATION_FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CalibrationMissing(
                f"{folder} is not a calibration folder (no {path.name})"
            ) from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not JSON: {err}") from None
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema {raw.get('schema')} is not {SCHEMA}")
        return cls(
            folder,
            CalibrationKey(**raw["key"]),
            tuple(raw["tp"]),
            raw.get("processor", ""),
            tuple(raw.get("warnings", ())),
        )

    def save(self, extra: dict | None = None) -> None:
        data = {
            "schema": SCHEMA,
            "key": asdict(self.key),
            "tp": sorted(self.tp_degrees),
            "processor": self.processor,
            "warnings": list(self.warnings),
            **(extra or {}),
        }
        (self.folder / CALIBRATION_FILE).write_text(json.dumps(data, indent=2) + "\n")


def config_sha256(model: str | Path) -> str:
    path = Path(model) / "config.json"
    if not path.is_file():
        raise no_config_error(model)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_key(model: str | Path, device_name: str, dtype: str) -> CalibrationKey:
    return CalibrationKey(Path(model).resolve().name, config_sha256(model), device_name, dtype)


def processor_name() -> str:
    """This machine's CPU model, for the record (calibrations on CPUs are keyed as "cpu")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_root() -> Path:
    return Path(os.environ.get("DILASERVE_CACHE", Path.home() / ".cache" / "dilaserve"))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def candidate_folders(model: str | Path, key: CalibrationKey) -> list[Path]:
    """Where a calibration for `key` is looked for, and written: next to the model, then the
    cache."""
    leaf = f"{_slug(key.device)}-{key.dtype}"
    cached = cache_root() / "calibration" / f"{_slug(key.model)}-{key.config_sha256[:12]}" / leaf
    return [Path(model) / FOLDER_NAME / leaf, cached]


def writable_folder(model: str | Path, key: CalibrationKey) -> Path:
    """The first candidate folder that can be written (created if need be)."""
    for folder in candidate_folders(model, key):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / ".write-test"
            probe.write_text("")
            probe.unlink()
            return folder
        except OSError:
            continue
    raise OSError(f"cannot write a calibration for {key.describe()} anywhere; give --calibration")


def calibrate_command(model: str | Path, key: CalibrationKey, tps, device: str) -> str:
    tp = ",".join(map(str, sorted(tps)))
    return f"dilaserve calibrate {model} --device {device} --dtype {key.dtype} --tp {tp}"


def find_calibration(
    model: str | Path, key: CalibrationKey, tps, device: str, folder: str | Path | None = None
) -> Calibration:
    """The calibration of `model` for `key` that covers every TP degree in `tps`.

    `folder` names one (it must match); else the candidate folders are searched. Raises
    `CalibrationMissing` with the command that would make it.
    """
    wanted = set(tps)
    run = calibrate_command(model, key, wanted, device)
    places = [Path(folder)] if folder else candidate_folders(model, key)
    found = []
    for place in places:
        if not (place / CALIBRATION_FILE).is_file():
            if folder:
                raise CalibrationMissing(f"{place} is not a calibration folder; run: {run}")
            continue
        calibration = Calibration.load(place)
        if not calibration.key.matches(key):
            found.append(f"{place} was made for {calibration.key.describe()}")
            continue
        missing = wanted - set(calibration.tp_degrees)
        if missing:
            tps_made = ",".join(map(str, calibration.tp_degrees))
            found.append(f"{place} covers tp={tps_made} only")
            continue
        return calibration
    why = f" ({'; '.join(found)})" if found else ""
    raise CalibrationMissing(f"no calibration for {key.describe(wanted)}{why}; run: {run}")


@dataclass(frozen=True)
class ControlInputs:
    """The latency profile file and step predictor folder the control plane is built from, and
    what they are (for `/v1/models` and the logs)."""

    profile: str
    predictor: str | None
    label: dict = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    dws_cost: str | None = None
    quality: str | None = None  # the calibration's quality curve (an eval summary.json)


def materialize_preset(name: str) -> Path:
    """A preset latency profile (`sim/latency.py`) written once to the cache as a file, so that
    the control plane reads presets and measured profiles alike."""
    from dilaserve.sim.profiles import load_profile

    profile = load_profile(name)
    path = cache_root() / "presets" / f"{_slug(name)}.json"
    text = json.dumps(profile.to_dict(), indent=1) + "\n"
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def profile_source(spec: str) -> tuple[str, dict]:
    """A `--profile` value as a file path, and its label: a preset name, or a file."""
    if Path(spec).is_file():
        return spec, {"source": "file", "profile": spec}
    return str(materialize_preset(spec)), {"source": "preset", "name": spec}


def resolve_control_inputs(
    model: str | Path,
    key: CalibrationKey,
    tps,
    device: str,
    *,
    calibration: str | Path | None = None,
    profile: str | None = None,
    predictor: str | None = None,
    needs_predictor: bool = True,
) -> ControlInputs:
    """What the control plane of `model` served on `device` at TP degrees `tps` is built from.

    An explicit `profile` (a file or a preset name) and `predictor` win; what is not given comes
    from the matching calibration, which must exist (`CalibrationMissing` otherwise).
    """
    if profile is not None and (predictor is not None or not needs_predictor):
        path, label = profile_source(profile)
        _check_covers(path, tps, profile)
        return ControlInputs(path, predictor, label)
    try:
        found = find_calibration(model, key, tps, device, calibration)
    except CalibrationMissing as err:
        if profile is not None:
            raise CalibrationMissing(f"{err} (or give --predictor DIR)") from None
        raise
    label = found.label()
    path = str(found.profile)
    if profile is not None:
        path, preset = profile_source(profile)
        _check_covers(path, tps, profile)
        label = {**label, "profile": preset}
    cost = str(found.dws_cost) if found.dws_cost else None
    quality = str(found.quality) if found.quality else None
    predictor = predictor or str(found.predictor)
    return ControlInputs(path, predictor, label, _warnings(found), cost, quality)


def _warnings(found: Calibration) -> tuple[str, ...]:
    """What the server should warn about a calibration it uses, a line per kind of warning: the
    profile points that stayed implausible are counted in one (`calibrate` listed them, and
    `calibration.json` keeps them)."""
    points = [w for w in found.warnings if w.startswith("tp=")]
    notes = tuple(f"calibration {found.folder}: {w}" for w in found.warnings if w not in points)
    if points:
        more = f" and {len(points) - 1} more" if len(points) > 1 else ""
        notes += (
            f"calibration {found.folder}: {len(points)} profile points stayed implausible "
            f"({points[0]}{more}; listed in its {CALIBRATION_FILE}): re-run dilaserve calibrate "
            "on a quiet machine to clear them",
        )
    here = processor_name()
    if found.key.device == "cpu" and found.processor and found.processor != here:
        notes += (
            f"calibration {found.folder} was measured on {found.processor}, this CPU is {here}: "
            f"latency predictions may be off (run dilaserve calibrate to measure this one)",
        )
    return notes


def _check_covers(path: str, tps, name: str) -> None:
    from dilaserve.control.profile import LatencyProfile

    have = LatencyProfile.from_file(path).tp_degrees
    missing = sorted(set(tps) - set(have))
    if missing:
        raise ValueError(
            f"latency profile {name} has no points for tp={','.join(map(str, missing))} "
            f"(it has tp={','.join(map(str, have))})"
        )
