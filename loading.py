"""loading.py: models, tokenizers and data from the Hugging Face hub or local files, each failure
one line that names the problem and its fix, never a traceback from inside a library. cwgrpo.py,
evaluate.py and the tools load through it; it knows nothing of cwgrpo.
"""

import functools
import json
import socket
import urllib.parse
from pathlib import Path

import datasets
import huggingface_hub
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

OFFLINE_HINT = "the hub cannot be reached from here, so only what is cached loads"


@functools.cache
def hub_reachable() -> bool:
    """One quick look (3 s at most) for the hub before anything is loaded from it. Where it
    cannot be reached, the libraries go offline at once (loading from their cache), instead of
    retrying each file for half a minute before failing."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return False
    url = urllib.parse.urlsplit(huggingface_hub.constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=3).close()
        return True
    except OSError:
        huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
        return False


def hub_hint(name: str) -> str:
    """What a loading error adds for a name that is no local path, where the hub is out of reach."""
    return "" if Path(name).exists() or hub_reachable() else f"{OFFLINE_HINT}; "


LOCAL_DATA_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_dataset(name: str, split: str, question_column: str, gold_column: str):
    """A hub dataset or a local file, checked to have the question and gold columns."""
    path, local = Path(name), Path(name).suffix in LOCAL_DATA_FORMATS
    if local:
        check_local_data(path)
    datasets.disable_progress_bars()  # no "Generating train split" bar on every run
    hub_hint(name)  # an unreachable hub: offline before the first request
    try:
        dataset = (
            datasets.load_dataset(
                LOCAL_DATA_FORMATS[path.suffix], data_files=str(path), split="train"
            )
            if local
            else datasets.load_dataset(name, split=split)
        )
    except (ConnectionError, OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        hint = (
            "fix the file"
            if local
            else hub_hint(name)
            + (
                "check the name, or download it while online (it "
                "is then read from the cache), or pass a local "
                ".json/.jsonl/.parquet/.csv file"
            )
        )
        raise SystemExit(
            f"error: cannot load dataset '{name}' (split '{split}'): {first_line(e)}; {hint}"
        ) from None
    if len(dataset) == 0:
        raise SystemExit(f"error: dataset '{name}' has no rows; give a file with some")
    missing = [c for c in (question_column, gold_column) if c not in dataset.column_names]
    if missing:
        raise SystemExit(
            f"error: dataset '{name}' has no column {', '.join(map(repr, missing))}; "
            f"columns found: {', '.join(dataset.column_names)}. "
            f"Set --question-column and --gold-column"
        )
    return dataset


def check_local_data(path: Path) -> None:
    """A local data file exists, has rows, and (.jsonl) holds valid JSON on every line."""
    if not path.is_file():
        raise SystemExit(f"error: dataset file {path} does not exist")
    if path.stat().st_size == 0:
        raise SystemExit(f"error: dataset file {path} is empty; give a file with some rows")
    if path.suffix == ".jsonl":
        with path.open() as lines:
            for number, line in enumerate(lines, 1):
                try:
                    line.strip() and json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(
                        f"error: {path} line {number} is not valid JSON ({e.msg}); "
                        f"fix or remove that line"
                    ) from None


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_model(path: str, dtype: torch.dtype, device: torch.device):
    hint = hub_hint(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as e:
        raise SystemExit(
            f"error: cannot load model '{path}': {first_line(e)} {hint}Download it while "
            f"online (huggingface-cli download {path}) or pass a local folder with "
            f"--model"
        ) from None
    return model.to(device)


def load_reference(path: str, device: torch.device):
    """The frozen KL reference model, held in bf16 on CUDA."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return load_model(path, dtype, device).eval().requires_grad_(False)


def load_tokenizer(path: str):
    hint = hub_hint(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    except OSError as e:
        raise SystemExit(
            f"error: cannot load the tokenizer of '{path}': {first_line(e)} {hint}".rstrip("; ")
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_model_path(model: str, hint: str = "") -> None:
    """A model that names a local path must exist: one line if not. A name is a local path when
    it starts with . / or ~, has more than one /, or lies in a folder that exists here (runs/x);
    anything else ("org/name") is a hub id."""
    path = Path(model).expanduser()
    slashes = model.count("/")
    local = (
        model.startswith((".", "/", "~")) or slashes > 1 or (slashes == 1 and path.parent.is_dir())
    )
    if local and not path.exists():
        raise SystemExit(f"error: --model {model}: no such folder{hint}")


def eos_token_ids(generation_config, tokenizer) -> list[int]:
    """The tokens a completion ends at: the generation config's EOS ids, else the tokenizer's."""
    ids = generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return ids or [tokenizer.eos_token_id]


def generation_config(model_path: str) -> GenerationConfig:
    """The generation config a model loaded from model_path gets: its generation_config.json, or
    one made from its config.json when it ships none (as from_pretrained does)."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        config = AutoConfig.from_pretrained(model_path)
        return GenerationConfig.from_model_config(config)


def chat_prompt_ids(tokenizer, question: str, system_prompt: str) -> list[int]:
    """A question as the model's chat template writes it, ready for the assistant's answer."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]


def enable_checkpointing(model) -> None:
    """Activation (gradient) checkpointing. transformers renamed gradient_checkpointing_enable to
    activation_checkpointing_enable, warning on the old name; older 5.x releases (vLLM pins one)
    have only the old name."""
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()


class PromptStream:
    """Tokenised (prompt, gold) pairs in a seeded order, reshuffled each epoch. Its position, a
    count of prompts served, is all a checkpoint needs. cfg: a cwgrpo Config (its question_column,
    gold_column, system_prompt, max_prompt_length and seed)."""

    def __init__(self, dataset, tokenizer, cfg):
        pairs = [
            (chat_prompt_ids(tokenizer, str(question), cfg.system_prompt), str(gold))
            for question, gold in zip(dataset[cfg.question_column], dataset[cfg.gold_column])
        ]
        self.items = [(ids, gold) for ids, gold in pairs if len(ids) <= cfg.max_prompt_length]
        self.skipped, self.seed, self.position = len(pairs) - len(self.items), cfg.seed, 0
        if self.skipped:
            print(f"skipped {self.skipped} prompts longer than --max-prompt-length")
        if not self.items:
            raise SystemExit(
                f"error: every prompt is longer than --max-prompt-length {cfg.max_prompt_length}"
            )

    @functools.lru_cache(maxsize=1)  # noqa: B019 - one stream per run, alive as long as the run
    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.items), generator=generator).tolist()

    def next_batch(self, n: int) -> list[tuple[list[int], str]]:
        batch = []
        for _ in range(n):
            epoch, index = divmod(self.position, len(self.items))
            batch.append(self.items[self.order(epoch)[index]])
            self.position += 1
        return batch
