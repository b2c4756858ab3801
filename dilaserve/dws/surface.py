"""The Denoising Surface of a request (papers.md 2.2) and its training labels.

A request decodes a grid of cells: output block b (0..N-1) and denoising step s (0..T_b-1)
within it. Its labels are the executed block count N and the steps per block T_b. The surface
S[b, s] = P(N >= b+1) * P(T_b >= s+1 | block b reached) is the probability that a cell runs;
here it comes from two hazard heads (`surface_from_logits`), so it is monotone by construction:
rows never increase along s, the first column never increases along b.

Derived figures: expected blocks E[N] = sum_b S[b, 0]; expected total steps (the area) =
sum S; the coarse targets of Stage A, T(h) = sum_b min(T_b, h) for horizons h.

`collect_labels` runs each prompt to completion on the real engine at the serving threshold
and records its T_b (and so its N) as `Labels`; `split` divides them into training and
validation prompts. Training on them is `train.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HORIZONS = (1, 4, 8, 12, 16, 20, 24, 28, 32)  # Stage A's horizons h (papers.md 2.4)


def block_steps(block_indices: Sequence[int], max_blocks: int) -> np.ndarray:
    """T_b from the block each step worked on (a request's steps in order)."""
    steps = np.zeros(max_blocks, dtype=np.int32)
    for b in block_indices:
        if b >= max_blocks:
            raise ValueError(f"a step worked on block {b}, beyond max_blocks={max_blocks}")
        steps[b] += 1
    return steps


def horizon_targets(steps: np.ndarray, horizons: Sequence[int] = HORIZONS) -> np.ndarray:
    """T(h) = sum_b min(T_b, h): [requests, len(horizons)] from T_b [requests, blocks]."""
    return np.stack([np.minimum(steps, h).sum(axis=1) for h in horizons], axis=1).astype(np.float32)


def joint_target(steps: np.ndarray, block_len: int) -> np.ndarray:
    """1[cell executed]: [requests, blocks, block_len] from T_b [requests, blocks]."""
    s = np.arange(block_len)
    return (s[None, None, :] < steps[:, :, None]).astype(np.float32)


def surface_from_logits(count_logits: torch.Tensor, step_logits: torch.Tensor) -> torch.Tensor:
    """The surface [batch, blocks, block_len] from hazard logits.

    count_logits [batch, blocks-1]: sigmoid = P(N > k | N >= k), k = 1..blocks-1.
    step_logits [batch, blocks, block_len-1]: sigmoid = P(T_b > s | T_b >= s), s = 1..block_len-1.
    """
    batch = count_logits.shape[0]
    ones = count_logits.new_ones(batch, 1)
    block_survival = torch.cumprod(torch.cat((ones, torch.sigmoid(count_logits)), dim=1), dim=1)
    blocks = step_logits.shape[1]
    first = step_logits.new_ones(batch, blocks, 1)
    step_survival = torch.cumprod(torch.cat((first, torch.sigmoid(step_logits)), dim=2), dim=2)
    return block_survival[:, :, None] * step_survival


def window_blocks(gen_len: int, block_len: int, aligned: bool) -> int:
    """The most blocks an output window of `gen_len` can span: the engine rounds the window up
    to whole blocks, and where blocks sit at absolute positions (`aligned`: block-causal models,
    `protocol.block_offset`) a window that starts inside a block spans one more."""
    return -(-gen_len // block_len) + int(aligned)


def support(surface: np.ndarray, gen_len: int, block_len: int, prompt_tokens=None) -> np.ndarray:
    """Zero the blocks a request's output window cannot reach (no renormalisation).

    prompt_tokens: None where the window starts at a block's start (blocks aligned to the
    window); else each row's prompt length, for blocks at absolute positions, where a window
    that starts `P mod block_len` into its first block reaches one block further."""
    out = surface.copy()
    blocks = -(-gen_len // block_len)  # the engine rounds the window up to whole blocks
    if prompt_tokens is None:
        out[..., blocks:, :] = 0.0
        return out
    offsets = np.asarray(prompt_tokens) % block_len
    reach = -(-(blocks * block_len + offsets) // block_len)  # blocks each window spans
    unreached = np.arange(out.shape[-2]) >= np.asarray(reach)[..., None]
    out[unreached] = 0.0
    return out


def step_cap(surface: np.ndarray, steps: int) -> np.ndarray:
    """The surface of a step schedule of `steps` a block: a block ends after at most that many
    steps, so the cells from step `steps` on never run (no renormalisation)."""
    out = surface.copy()
    out[..., max(steps, 1) :] = 0.0
    return out


@dataclass
class Labels:
    texts: list[str]
    prompt_tokens: np.ndarray  # [n] under the serving model's tokenizer
    steps: np.ndarray  # [n, max_blocks] T_b
    output_tokens: np.ndarray  # [n] generated tokens before the stop token
    block_len: int
    threshold: float
    # blocks at absolute positions (block-causal models): a window then starts P mod block_len
    # into its first block and may span one block more (`window_blocks`)
    aligned_blocks: bool = False

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, index: np.ndarray) -> Labels:
        return Labels(
            [self.texts[i] for i in index],
            self.prompt_tokens[index],
            self.steps[index],
            self.output_tokens[index],
            self.block_len,
            self.threshold,
            self.aligned_blocks,
        )

    def save(self, path: str | Path) -> None:
        np.savez_compressed(
            path,
            texts=np.array(self.texts, dtype=object),
            prompt_tokens=self.prompt_tokens,
            steps=self.steps,
            output_tokens=self.output_tokens,
            meta=np.array([self.block_len, self.threshold, float(self.aligned_blocks)]),
        )

    @classmethod
    def load(cls, path: str | Path) -> Labels:
        path = Path(path)
        z = np.load(path if path.suffix == ".npz" else path.with_suffix(".npz"), allow_pickle=True)
        block_len, threshold, *aligned = z["meta"].tolist()  # older files: no aligned flag
        return cls(
            z["texts"].tolist(),
            z["prompt_tokens"],
            z["steps"],
            z["output_tokens"],
            int(block_len),
            float(threshold),
            bool(aligned and aligned[0]),
        )


def collect_labels(
    model_path: str | Path,
    texts: list[str],
    gen_len: int,
    threshold: float = 0.9,
    max_batch: int = 128,
) -> Labels:
    """Run every prompt to completion on the engine (chat template) and record T_b.

    T_b is indexed by the window's blocks as the engine runs them: for a block-causal model
    (blocks at absolute positions, its exact block cache) a window that starts inside a block
    spans one block more, so the labels have that extra column."""
    from dilaserve.config import EngineConfig, SamplingParams
    from dilaserve.engine.llm import LLM

    llm = LLM(model_path, EngineConfig())
    block = llm.config.block_len
    aligned = llm.engine.family.is_block_causal
    requests = llm.make_requests(texts, SamplingParams(threshold, gen_len), chat=True)
    blocks: dict[str, list[int]] = {r.request_id: [] for r in requests}
    llm.run(
        requests, max_batch, on_step=lambda r, res: blocks[r.request_id].append(res.block_index)
    )
    max_blocks = window_blocks(gen_len, block, aligned)
    stop = llm.tokenizer.special.stop_ids
    return Labels(
        list(texts),
        np.array([r.prompt_len for r in requests]),
        np.stack([block_steps(blocks[r.request_id], max_blocks) for r in requests]),
        np.array([len(r.generated_ids(stop)) for r in requests]),
        block,
        threshold,
        aligned,
    )


def split(labels: Labels, val_share: float, seed: int) -> tuple[Labels, Labels]:
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(len(labels) * (1 - val_share))
    return labels.subset(order[:cut]), labels.subset(order[cut:])
