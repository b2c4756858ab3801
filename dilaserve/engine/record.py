"""Record denoising trajectories on the real engine (step predictor data, simulator replay)."""

from __future__ import annotations

import numpy as np

from dilaserve.config import SamplingParams
from dilaserve.engine.llm import LLM
from dilaserve.trajectory import Trajectory


def record_trajectories(
    llm: LLM, prompts: list[str], thresholds, max_tokens: int = 64, max_batch: int = 128
) -> list[Trajectory]:
    """Run every prompt to completion at every threshold, logging each step."""
    out = []
    for threshold in thresholds:
        requests = llm.make_requests(prompts, SamplingParams(threshold, max_tokens))
        steps: dict[str, list] = {r.request_id: [] for r in requests}
        seen = {r.request_id: np.zeros(r.gen_len, dtype=bool) for r in requests}

        def on_step(request, result, steps=steps, seen=seen):
            """A step's new commits only: a token-editing step also rewrites committed ones."""
            done = seen[request.request_id]
            new = result.positions[~done[result.positions]]
            done[new] = True
            steps[request.request_id].append(
                (result.kind.value, new.copy(), result.confidences.copy())
            )

        llm.run(requests, max_batch, on_step)
        for index, r in enumerate(requests):
            kinds, commits, confs = zip(*steps[r.request_id])
            out.append(
                Trajectory(
                    index,
                    threshold,
                    r.prompt_len,
                    r.gen_len,
                    r.block_len,
                    tuple(kinds),
                    tuple(commits),
                    np.stack(confs),
                    r.block_offset,
                    r.edits,
                )
            )
    return out
