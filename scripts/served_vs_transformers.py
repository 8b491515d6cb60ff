"""Serve a model in a REAL TorchServe the way the pipeline does and compare every answer with
`transformers.pipeline(<task>)` on the same eager model (issue 26: "tried with models the tests never saw").

    python scripts/served_vs_transformers.py FOLDER --task text-classification [--requests 48]
    python scripts/served_vs_transformers.py --params examples/efficientnet-lite0/params.yaml

The folder's model goes through the pipeline's own steps (pipeline/serve/variant_server.py: prepare's
golden set, the `eager` variant built and verified, the .mar with its handler, config.properties) and
is served in TorchServe 0.12 (4 concurrent clients, batches of up to 4 requests, so answers come from
mixed batches), always stopped. N seeded requests in the task's client format:
- text-classification: text/plain, texts of 1 to ~150 words (over `--max-length` tokens: truncated,
  as the reference is told), pairs, lists, `top_k` (1, 2, all), `function_to_apply`;
- token-classification: aggregation none / simple / first / average / max, `ignore_labels`, lists,
  text/plain (the served default strategy), words split into pieces, accents, CJK, [UNK];
- rerank: TEI bodies with 10-50 texts per query, `top_n`, `return_text`, `raw_scores`;
- image-classification: PNG / JPEG / base64 JSON with `top_k` / `function_to_apply`, non-square images
  of several sizes (smaller and larger than the crop), grayscale, RGBA, an EXIF-rotated JPEG.
The reference for each: `transformers.pipeline(task)` on the folder (text-classification also with
`truncation=True, max_length` = the served cap; token-classification's text/plain with the served
default strategy), rerank: sigmoid of the eager cross-encoder's logits (only_second truncation at the
cap), highest first; a `state_dict` image model (transformers has no pipeline for it): its factory +
weights' own eager forward on transformers' BitImageProcessorPil set to params `model.image`, then
the task's score function. Labels, order, indices, entity words and offsets must be equal; scores
within 0.01 (`--atol`). Order swaps between items whose reference scores are within 1e-5 are ties,
counted, not failed. Prints a table per request kind and a JSON summary; exit 1 on any mismatch.
`--variant V` serves another variant instead of eager (fp16, bf16, onnx, ...: the winner the pipeline may
select), built and verified within its dtype's tolerances first (a rejected one stops the run, with the
reason), and still compared with the fp32 transformers reference.
`--in-process` runs the handler's task adapter on the eager model in this process instead of a
TorchServe (seconds; what the fast test uses). Results: docs/results/2026-12-tasks.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:       # run as a script: the repo's packages importable
    sys.path.insert(0, str(REPO_ROOT))

from scripts.served_compare.cases import TASKS  # noqa: E402
from scripts.served_compare.harness import run  # noqa: E402
from scripts.served_compare.judging import ATOL  # noqa: E402
from scripts.served_compare.summary import table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?",
                    help="an HF folder (config.json, weights, tokenizer.json / preprocessor_config.json)")
    ap.add_argument("--task", choices=TASKS, help="the folder's task (with --params: the params file's)")
    ap.add_argument("--params", help="a params file instead of a folder (e.g. a state_dict + factory image model)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=128, help="model.text.max_length served (tokens)")
    ap.add_argument("--variant", default="eager", help="the variant served (default eager, the exact reference)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--atol", type=float, default=ATOL)
    ap.add_argument("--workdir", help="where artifacts and the server's logs go (default a new temp dir)")
    ap.add_argument("--json-out", type=Path, help="also write the JSON summary here")
    ap.add_argument("--in-process", action="store_true", help="the handler's adapter in this process, no TorchServe")
    args = ap.parse_args(argv)
    if bool(args.folder) == bool(args.params):
        ap.error("give a FOLDER (with --task) or --params FILE")
    if args.folder and not args.task:
        ap.error("FOLDER needs --task")
    if args.in_process and args.variant != "eager":
        ap.error("--in-process runs the eager model; --variant needs a TorchServe")
    result = run(args)
    print(table(result))
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text + "\n")
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
