"""Parity of dilaserve's Dream and LLaDA2 modules with the published modeling code.

    python benchmarks/published_parity.py --dream-code Fast-dLLM/dream/model \\
        --llada2-code dllm/dllm/pipelines/llada2/models --site /tmp/hf

`--dream-code`: the package folder of Fast-dLLM's Dream (`modeling_dream.py`,
`configuration_dream.py`, ...); `--llada2-code`: a package folder with LLaDA2's remote code
(`modeling_llada2_moe.py`, `configuration_llada2_moe.py`; e.g. ZHZisZZ/dllm's copy); `--site`:
a folder with `transformers` 4.5x installed (`pip install --target`), kept out of the project's
environment. Nothing here is a test (the tests never import published code): this script runs
that code on tiny random checkpoints written with the published config keys and parameter
names (`tests/family_checkpoints.py`), and reports

- each family's logits against the published forward (fp32 and bf16);
- LLaDA2's greedy decoding with dilaserve's exact block cache against the published `generate`
  (no cache; `steps = block_length`, so it commits the tokens above the threshold or the single
  best, as dilaserve does), prompts a whole number of blocks long (the published `generate`
  decodes whole last blocks).

Writes `summary.json` in a run folder under `--out`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from family_checkpoints import dream_checkpoint, llada2_checkpoint, prompt_ids  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from dilaserve.config import EngineConfig  # noqa: E402
from dilaserve.engine.llm import LLM  # noqa: E402
from dilaserve.models.checkpoint import load_model  # noqa: E402
from dilaserve.request import Request  # noqa: E402
from dilaserve.runs import create_run_dir, environment, write_json  # noqa: E402

BLOCK = 8
DROPPED_KEYS = ("auto_map", "architectures", "torch_dtype")  # not config-class arguments


def import_package(folder: str, module: str):
    folder = Path(folder).resolve()
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module(f"{folder.name}.{module}")


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def published_model(path: Path, config_cls, model_cls, dtype):
    raw = json.loads((path / "config.json").read_text())
    config = config_cls(**{k: v for k, v in raw.items() if k not in DROPPED_KEYS})
    config._attn_implementation = "sdpa"
    model = model_cls(config)
    model.load_state_dict(state_dict(path), strict=True)
    return model.to(dtype).eval()


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    return {
        "max_abs_diff": (ours.float() - theirs.float()).abs().max().item(),
        "max_abs_logit": theirs.float().abs().max().item(),
        "top1_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
    }


def ours_logits(model, ids: torch.Tensor, **kw) -> torch.Tensor:
    n = ids.shape[1]
    hidden = model(ids, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool), **kw).hidden
    return model.logits(hidden)[0]


def dream_forward(path: Path, code: str, dtype) -> dict:
    mod, cfg_mod = (
        import_package(code, "modeling_dream"),
        import_package(code, "configuration_dream"),
    )
    ref = published_model(path, cfg_mod.DreamConfig, mod.DreamModel, dtype)
    ids = torch.tensor([prompt_ids(21)])
    with torch.no_grad():
        return compare(ours_logits(load_model(path, dtype), ids), ref(ids).logits[0])


def llada2_model(path: Path, code: str, dtype):
    mod = import_package(code, "modeling_llada2_moe")
    cfg_mod = import_package(code, "configuration_llada2_moe")
    return published_model(path, cfg_mod.LLaDA2MoeConfig, mod.LLaDA2MoeModelLM, dtype)


def llada2_forward(path: Path, ref, dtype) -> dict:
    n = 27
    ids = torch.tensor([prompt_ids(n)])
    blocks = torch.arange(n) // BLOCK
    mask = (blocks[None, :] <= blocks[:, None])[None, None]
    with torch.no_grad():
        theirs = ref(ids, attention_mask=mask, position_ids=torch.arange(n)[None]).logits[0]
        return compare(ours_logits(load_model(path, dtype), ids, block_len=BLOCK), theirs)


def llada2_generate(path: Path, ref, prompt_len: int, threshold: float) -> dict:
    """bf16 (the published generate's block mask is bf16, which SDPA refuses next to fp32)."""
    llm = LLM(path, EngineConfig("block", block_len=BLOCK, early_finish=False, dtype="bfloat16"))
    prompt = prompt_ids(prompt_len, offset=prompt_len)
    mask = llm.tokenizer.special.mask
    request = Request("r", prompt, 2 * BLOCK, BLOCK, mask, threshold)
    llm.run([request], 1)
    with torch.no_grad():
        theirs = ref.generate(
            torch.tensor([prompt]),
            block_length=BLOCK,
            steps=BLOCK,
            gen_length=2 * BLOCK,
            threshold=threshold,
            eos_id=-1,  # run the whole window, as dilaserve does with early_finish off
            mask_id=mask,
            temperature=0.0,
        )[0].tolist()
    ours = request.output_ids.tolist()
    return {"prompt_len": prompt_len, "threshold": threshold, "equal": ours == theirs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dream-code", required=True)
    parser.add_argument("--llada2-code", required=True)
    parser.add_argument("--site", default=None, help="a folder holding transformers")
    parser.add_argument("--out", default=str(ROOT / "runs"))
    args = parser.parse_args()
    if args.site:
        sys.path.insert(0, args.site)
    torch.set_num_threads(1)
    run = create_run_dir(args.out, "published_parity")
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_checks(Path(tmp), args)
    summary["environment"] = environment()
    summary["published_code"] = {"dream": args.dream_code, "llada2": args.llada2_code}
    write_json(run / "summary.json", summary)
    print(f"run folder: {run}")


def run_checks(tmp: Path, args) -> dict:
    dream, llada2 = dream_checkpoint(tmp / "dream"), llada2_checkpoint(tmp / "llada2")
    summary: dict = {"block_len": BLOCK}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        summary[f"dream_{name}"] = dream_forward(dream, args.dream_code, dtype)
        summary[f"llada2_{name}"] = llada2_forward(
            llada2, llada2_model(llada2, args.llada2_code, dtype), dtype
        )
    ref = llada2_model(llada2, args.llada2_code, torch.bfloat16)
    summary["llada2_generate"] = [
        llada2_generate(llada2, ref, p, g) for p, g in ((8, 0.9), (16, 0.5), (8, 0.99))
    ]
    for key, value in summary.items():
        print(f"{key}: {value}")
    return summary


if __name__ == "__main__":
    main()
