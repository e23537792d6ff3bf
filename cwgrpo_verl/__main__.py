"""Open-RS (or any problem/solution data) as verl's RL parquet, from the repository's root:

python -m cwgrpo_verl --dataset knoveleng/open-rs --output-dir data/open-rs-verl
"""

import argparse

from cwgrpo_verl.data import convert

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
parser.add_argument(
    "--dataset", default="knoveleng/open-rs", help="hub id or local .json/.jsonl/.parquet/.csv"
)
parser.add_argument("--output-dir", default="data/open-rs-verl")
parser.add_argument("--question-column", default="problem")
parser.add_argument("--gold-column", default="solution")
parser.add_argument(
    "--format-weight", type=float, default=1.0, help="0 for the 7B recipe (accuracy only)"
)
args = parser.parse_args()
print(
    convert(
        args.dataset,
        args.output_dir,
        args.question_column,
        args.gold_column,
        format_weight=args.format_weight,
    )
)
