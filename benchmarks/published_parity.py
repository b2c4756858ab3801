"""Parity of dilaserve's Dream and LLaDA2 modules with the published modeling code.

    python benchmarks/published_parity.py --dream-code Fast-dLLM/dream/model \\
        --llada2-code dllm/dllm/pipelines/llada2/models --site /tmp/hf

`--llada21-code` (optional): a package folder with LLaDA2.1's remote code
(`modeling_llada21_moe.py`, `configuration_llada21_moe.py`; ZHZisZZ/dllm's
`dllm/pipelines/llada21/models`) adds LLaDA2.1's token-editing decoding in its speed and
quality modes (`llada21_decoding.py`).

`--dream-code`: the package folder of Fast-dLLM's Dream (`modeling_dream.py`,
`configuration_dream.py`, ...); `--llada2-code`: a package folder with LLaDA2's remote code
(`modeling_llada2_moe.py`, `configuration_llada2_moe.py`; e.g. ZHZisZZ/dllm's copy); `--site`:
a folder with `transformers` 4.5x installed (`pip install --target`), kept out of the project's
environment. Nothing here is a test (the tests never import published code): this script runs
that code on tiny random checkpoints written with the published config keys and parameter
names (`tests/family_checkpoints.py`), and reports

- each family's logits against the published forward (fp32 and bf16);
- LLaDA2's greedy decoding with dilaserve's exact block cache against the published `generate`
  (no cache), in every setting of `llada2_decoding.py`'s grid: prompt lengths inside and on a
  block boundary, `max_tokens`, `steps`, thresholds and the three EOS modes; tokens and forward
  counts, case by case;
- Dream's decoding in the none, prefix and dual cache modes against Fast-dLLM's Dream decoders
  (`dream_decoding.py`; `none`: the whole-window decoder, at two step budgets), the same way.
Prints the tables docs/models/parity.md and docs/models/llada2.md carry.

Writes `summary.json` in a run folder under `--out`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import dream_decoding  # noqa: E402
import llada2_decoding  # noqa: E402
import llada21_decoding  # noqa: E402
from family_checkpoints import dream_checkpoint, llada2_checkpoint, prompt_ids  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from dilaserve.models.checkpoint import load_model  # noqa: E402
from dilaserve.runs import create_run_dir, environment, write_json  # noqa: E402

BLOCK = 8
DROPPED_KEYS = ("auto_map", "architectures", "torch_dtype")  # not config-class arguments


def import_package(folder: str, module: str):
    folder = Path(folder).resolve()
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module(f"{folder.name}.{module}")


def import_package_as(folder: str, module: str, alias: str):
    """`module` of the package `folder`, imported as package `alias` (dllm's LLaDA2.0 and
    LLaDA2.1 packages are both folders named `models`)."""
    if alias not in sys.modules:
        init = Path(folder).resolve() / "__init__.py"
        spec = importlib.util.spec_from_file_location(
            alias, init, submodule_search_locations=[str(init.parent)]
        )
        sys.modules[alias] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[alias])
    return importlib.import_module(f"{alias}.{module}")


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


def dream_model(path: Path, code: str, dtype):
    mod = import_package(code, "modeling_dream")
    cfg_mod = import_package(code, "configuration_dream")
    return published_model(path, cfg_mod.DreamConfig, mod.DreamModel, dtype)


def dream_forward(path: Path, code: str, dtype) -> dict:
    ref = dream_model(path, code, dtype)
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


def llada21_model(path: Path, code: str, dtype):
    mod = import_package_as(code, "modeling_llada21_moe", "published_llada21")
    cfg_mod = import_package_as(code, "configuration_llada21_moe", "published_llada21")
    return published_model(path, cfg_mod.LLaDA2MoeConfig, mod.LLaDA2MoeModelLM, dtype)


def llada21_checks(tmp: Path, code: str) -> dict:
    """LLaDA2.1's decoding in both published modes, on a random checkpoint and on one with the
    mask row scaled down (fp32)."""
    generate = {
        name: llada21_decoding.compare(
            lambda path: llada21_model(path, code, torch.float32), BLOCK, tmp, quiet
        )
        for name, quiet in (("random", False), ("mask_row_scaled", True))
    }
    print("\nllada2.1 against the published decoding (fp32)")
    print(
        "| checkpoint | mode / EOS | cases | tokens equal | forwards equal | forwards (ours, "
        "published) | published top-1 the mask token | published did not end | differing without "
        "the mask top-1 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, summary in generate.items():
        for mode, row in summary["modes"].items():
            counts = f"{row['cases']} | {row['tokens_equal']} | {row['forwards_equal']}"
            print(
                f"| {name} | {mode} | {counts} | {row['forwards']} | "
                f"{row['published_mask_top1']} | {row['published_not_ended']} | "
                f"{row['differing_without_mask_top1']} |"
            )
    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dream-code", required=True)
    parser.add_argument("--llada2-code", required=True)
    parser.add_argument("--llada21-code", default=None)
    parser.add_argument("--site", default=None, help="a folder holding transformers")
    parser.add_argument("--out", default=str(ROOT / "runs"))
    args = parser.parse_args()
    if args.site:
        sys.path.insert(0, args.site)
    torch.set_num_threads(1)
    run = create_run_dir(args.out, "published_parity")
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_checks(Path(tmp), args)
        if args.llada21_code:
            summary["llada21_generate"] = llada21_checks(Path(tmp), args.llada21_code)
    summary["environment"] = environment()
    summary["published_code"] = {"dream": args.dream_code, "llada2": args.llada2_code}
    summary["published_code"]["llada21"] = args.llada21_code
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
    # fp32, so that both sides round alike (no cache there, an exact cache here)
    variants = (("random", False), ("mask_row_scaled", True))
    summary["llada2_generate"] = {
        name: llada2_decoding.compare(
            lambda path: llada2_model(path, args.llada2_code, torch.float32), BLOCK, tmp, quiet
        )
        for name, quiet in variants
    }
    whole, blocks = (
        import_package(args.dream_code, name)
        for name in ("generation_utils", "generation_utils_block")
    )
    generation = {"none": whole, "prefix": blocks, "dual": blocks}
    summary["dream_generate"] = {
        name: dream_decoding.compare(
            lambda path: dream_model(path, args.dream_code, torch.float32),
            generation,
            BLOCK,
            tmp,
            quiet,
        )
        for name, quiet in variants
    }
    for key, value in summary.items():
        if not key.endswith("_generate"):
            print(f"{key}: {value}")
    for family in ("llada2", "dream"):
        print_table(summary, family)
    return summary


def print_table(summary: dict, family: str) -> None:
    diff = max(summary[f"{family}_{d}"]["max_abs_diff"] for d in ("float32", "bfloat16"))
    print(f"\n{family} against the published decoding (fp32)")
    print(
        "| checkpoint | mode | cases | tokens equal | forwards equal | max logit difference "
        "| published top-1 the mask token | differing without it |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, generate in summary[f"{family}_generate"].items():
        for mode, row in generate["modes"].items():
            counts = f"{row['cases']} | {row['tokens_equal']} | {row['forwards_equal']}"
            unexplained = sum(not r["published_mask_top1"] for r in row["differing"])
            mask_top1 = row["published_mask_top1"]
            print(f"| {name} | {mode} | {counts} | {diff} | {mask_top1} | {unexplained} |")


if __name__ == "__main__":
    main()
