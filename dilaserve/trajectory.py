"""Recorded denoising trajectories: which positions each step committed, with confidences.

One `Trajectory` is one request run to completion at one fixed threshold. They are the step
predictor's training data and, in simulation, the behaviour model that is replayed. Stored as a
single compressed `.npz` file. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Trajectory:
    prompt_index: int
    threshold: float
    prompt_len: int
    gen_len: int
    block_len: int
    kinds: tuple[str, ...]  # step kind of each step
    commits: tuple[np.ndarray, ...]  # output positions committed by each step
    confidences: np.ndarray  # [num_steps, gen_len], after each step
    block_offset: int = 0  # block-causal models: blocks start at absolute positions
    edits: bool = False  # token editing: a step that commits nothing is an edit-only step

    @property
    def num_steps(self) -> int:
        return len(self.commits)

    def edit_steps_by_block(self) -> dict[int, int]:
        """Token editing: the edit-only steps each block ran after its masks were committed
        (the steps that committed nothing, each counted to the block of the last commit);
        empty without editing."""
        out: dict[int, int] = {}
        block = None
        for positions in self.commits:
            if positions.size:
                block = int(positions.max() + self.block_offset) // self.block_len
            elif self.edits and block is not None:
                out[block] = out.get(block, 0) + 1
        return out

    def states(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(steps done, committed mask, confidences) before each step."""
        committed = np.zeros(self.gen_len, dtype=bool)
        confidences = np.zeros(self.gen_len, dtype=np.float32)
        for t in range(self.num_steps):
            yield t, committed.copy(), confidences
            committed[self.commits[t]] = True
            confidences = self.confidences[t]


def save_trajectories(path: str | Path, trajectories: list[Trajectory]) -> None:
    meta = np.array(
        [
            (t.prompt_index, t.threshold, t.prompt_len, t.gen_len, t.block_len, t.num_steps)
            for t in trajectories
        ],
        dtype=np.float64,
    )
    counts = np.array([len(c) for t in trajectories for c in t.commits], dtype=np.int32)
    positions = np.concatenate([c for t in trajectories for c in t.commits] or [np.zeros(0)])
    width = max(t.gen_len for t in trajectories)
    conf = np.zeros((int(meta[:, 5].sum()), width), dtype=np.float32)  # exact: refits reproduce
    row = 0
    for t in trajectories:
        conf[row : row + t.num_steps, : t.gen_len] = t.confidences
        row += t.num_steps
    kinds = np.array([k for t in trajectories for k in t.kinds])
    np.savez_compressed(
        path,
        meta=meta,
        counts=counts,
        positions=positions.astype(np.int32),
        confidences=conf,
        kinds=kinds,
        offsets=np.array([t.block_offset for t in trajectories], dtype=np.int32),
        edits=np.array([t.edits for t in trajectories], dtype=bool),
    )


def load_trajectories(path: str | Path) -> list[Trajectory]:
    data = np.load(path)
    meta, counts, positions = data["meta"], data["counts"], data["positions"]
    conf, kinds = data["confidences"], data["kinds"]
    # files written before block-causal models had no offsets: every block at the window
    offsets = data["offsets"] if "offsets" in data else np.zeros(len(meta), dtype=np.int32)
    edits = data["edits"] if "edits" in data else np.zeros(len(meta), dtype=bool)  # (older: none)
    out, step, pos = [], 0, 0
    for (prompt_index, threshold, prompt_len, gen_len, block_len, num_steps), offset, edit in zip(
        meta, offsets, edits
    ):
        n, gen_len = int(num_steps), int(gen_len)
        commits = []
        for c in counts[step : step + n]:
            commits.append(positions[pos : pos + c])
            pos += c
        out.append(
            Trajectory(
                int(prompt_index),
                float(threshold),
                int(prompt_len),
                gen_len,
                int(block_len),
                tuple(str(k) for k in kinds[step : step + n]),
                tuple(commits),
                conf[step : step + n, :gen_len],
                int(offset),
                bool(edit),
            )
        )
        step += n
    return out
