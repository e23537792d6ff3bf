"""The reward and the data in verl's formats, with no need of verl itself: compute_score, verl's
custom_reward_function (custom_reward_function.path=cwgrpo_verl/data.py), and convert, Open-RS (or
any problem/solution data) as verl's RL parquet (python -m cwgrpo_verl)."""

from pathlib import Path

import cwgrpo
from cwgrpo_utils import OPEN_RS_SYSTEM_PROMPT
from cwgrpo_utils.machine.grading_pool import Grader
from cwgrpo_utils.models import loading

_grader = None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's custom_reward_function: cwgrpo's accuracy (math-verify, gold first) + format reward,
    1:1 as in the 1.5B recipe (format_weight 0 in extra_info: the 7B recipe's accuracy only)."""
    global _grader
    if _grader is None:
        _grader = Grader(cwgrpo.grade_accuracy, on_timeout=cwgrpo.TIMED_OUT)
    format_weight = (extra_info or {}).get("format_weight", 1.0)
    return _grader.grade(
        solution_str, ground_truth
    ).accuracy + format_weight * cwgrpo.format_reward(solution_str)


def convert(
    dataset: str,
    output_dir: str,
    question_column: str = "problem",
    gold_column: str = "solution",
    system_prompt: str = OPEN_RS_SYSTEM_PROMPT,
    format_weight: float = 1.0,
) -> Path:
    """Open-RS (or any problem/solution data) as verl's RL parquet: prompt, reward rule, gold."""
    rows = loading.load_dataset(dataset, "train", question_column, gold_column)

    def to_verl(row, index):
        prompt = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": str(row[question_column])}
        ]
        return {
            "data_source": dataset,
            "prompt": prompt,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(row[gold_column])},
            "extra_info": {"index": index, "format_weight": format_weight},
        }

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows.map(to_verl, with_indices=True, remove_columns=rows.column_names).to_parquet(
        str(out / "train.parquet")
    )
    return out / "train.parquet"
