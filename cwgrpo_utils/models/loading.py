"""Models, tokenizers and data from the Hugging Face hub or local files, and the device they go to:
each failure one line that names the problem and its fix, never a traceback from inside a
library. cwgrpo.py, evaluate.py and the tools load through it. Also what a model runs with beyond
its weights: the attention mask of a padded batch, the KV cache, activation checkpointing.
"""

import collections
import functools
import inspect
import json
import socket
import urllib.parse
from pathlib import Path

import datasets
import huggingface_hub
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
)

from cwgrpo_utils.models import lora
from cwgrpo_utils.options import cli

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
    return without_empty_rows(dataset, name, (question_column, gold_column))


def without_empty_rows(dataset, name: str, columns: tuple[str, str]):
    """The rows whose question and gold both hold something: a null cell would reach the prompt
    or the grader as the string "None" and score 0 whatever the model answers. The rows left out
    are counted in one line; a dataset with none left is an error."""
    skipped, keep = collections.Counter(), []
    for index, cells in enumerate(zip(*(dataset[column] for column in columns))):
        empty = [c for c, cell in zip(columns, cells) if cell is None or not str(cell).strip()]
        if empty:
            skipped[" and ".join(empty)] += 1
        else:
            keep.append(index)
    if not keep:
        raise SystemExit(
            f"error: dataset '{name}' has no row with both a {columns[0]} and a {columns[1]}; "
            f"check --question-column and --gold-column"
        )
    if skipped:
        reasons = [f"empty {what}" + f" ({n})" * (len(skipped) > 1) for what, n in skipped.items()]
        print(f"skipped {skipped.total()} of {len(dataset)} rows: {', '.join(reasons)}")
    return dataset.select(keep) if skipped else dataset


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
    adapter = Path(path) / "adapter_config.json"
    if adapter.is_file():  # a LoRA checkpoint: its base model with the adapter merged in
        base = json.loads(adapter.read_text())["base_model_name_or_path"]
        adapted = lora.load_adapter(load_model(base, dtype, device), path, trainable=False)
        return lora.merged_model(adapted)
    hint = hub_hint(path)
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar on every run
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as e:
        raise SystemExit(
            f"error: cannot load model '{path}': {first_line(e)} {hint}Download it while "
            f"online (huggingface-cli download {path}) or pass a local folder with "
            f"--model"
        ) from None
    return model.to(device)


def load_policy(cfg, run_cfg, checkpoint, precision):
    """The model a run trains (cfg its algorithm's options, run_cfg its run's): fp32 master weights,
    the checkpoint's when resuming; with LoRA (run_cfg.lora_rank > 0) the frozen base in the run's
    half precision (bf16 or fp16; fp32 on a CPU) under an fp32 adapter, the checkpoint's or a fresh
    one drawn from cfg.seed. With run_cfg.gradient_checkpointing, its activations are recomputed in
    backward."""
    if not run_cfg.lora_rank:
        model = load_model(str(checkpoint or cfg.model), torch.float32, precision.device)
    else:
        base = load_model(cfg.model, precision.dtype, precision.device).requires_grad_(False)
        if checkpoint is None:
            model = lora.adapted(
                base,
                run_cfg.lora_rank,
                run_cfg.lora_alpha,
                target_modules=run_cfg.lora_target_modules,
                seed=cfg.seed,
            )
        else:
            model = lora.load_adapter(base, checkpoint)
    if run_cfg.gradient_checkpointing:
        enable_checkpointing(model)
    return model


def load_reference(path: str, precision):
    """The frozen KL reference model, held in the run's half precision (bf16 or fp16)."""
    return load_model(path, precision.dtype, precision.device).eval().requires_grad_(False)


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


def note_template_system_prompt(tokenizer, system_prompt: str) -> None:
    """With no system prompt of ours, say once what the chat template puts there itself (SmolLM2's
    and Qwen2.5's write a default one; ChatML's, nothing): the prompt the model sees."""
    user = [{"role": "user", "content": "\x00"}]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False)
    bare = render(user)
    around = render([{"role": "system", "content": "\x01"}] + user).split("\x01")
    own = len(around) == 2 and bare.startswith(around[0]) and bare.endswith(around[1])
    default = bare[len(around[0]) : len(bare) - len(around[1])] if own else ""
    if not system_prompt and default:
        cli.warn_once(
            f"template system prompt {default}",
            f'note: no --system-prompt given, so the chat template writes its own: "{default}"; '
            f"pass --system-prompt to replace it",
        )


def check_model_path(model: str) -> None:
    """A model must be there before anything else is made: one line if not. A name is a local path
    when it starts with . / or ~, has more than one /, or lies in a folder that exists here
    (runs/x); anything else ("org/name") is a hub id, which must be cached where the hub cannot
    be reached."""
    path = Path(model).expanduser()
    if path.exists():
        return
    slashes = model.count("/")
    if model.startswith((".", "/", "~")) or slashes > 1 or (slashes == 1 and path.parent.is_dir()):
        raise SystemExit(f"error: --model {model}: no such folder")
    cached = huggingface_hub.try_to_load_from_cache(model, "config.json")
    if not isinstance(cached, str) and not hub_reachable():
        raise SystemExit(
            f"error: --model {model}: no such folder, and no hub model of that name is cached; "
            f"{OFFLINE_HINT}"
        )


def generation_config(model_path: str) -> GenerationConfig:
    """The generation config a model loaded from model_path gets: its generation_config.json, or
    one made from its config.json when it ships none (as from_pretrained does)."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        config = AutoConfig.from_pretrained(model_path)
        return GenerationConfig.from_model_config(config)


def eos_ids(model, tokenizer) -> list[int]:
    """The token ids a completion ends at: the model's (or a vLLM engine's) generation config's
    EOS, one id or several, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or []) or [tokenizer.eos_token_id]


def attention_mask(model, mask: torch.Tensor) -> torch.Tensor | None:
    """What to pass as attention_mask for a full forward pass over a batch whose 2D mask is `mask`
    (1: a real token). Without left padding, None: right padding cannot reach a real token under
    causal attention, and SDPA's causal kernel needs no mask. Else, for SDPA, a (B, 1, L, L) causal
    mask on real keys in which every position also sees itself: a left pad sees nothing in the
    plain mask, some CUDA kernels give NaN for such a row, and 0 x NaN reaches real tokens through
    the values in the next layer. Real positions attend exactly as with the plain mask."""
    if bool(mask[:, 0].all()):
        return None
    if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
        return mask  # other attention implementations take the 2D mask
    length = mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    seen = mask.bool()[:, None, None, :] | torch.eye(length, dtype=torch.bool, device=mask.device)
    return causal & seen


class KVCache(DynamicCache):
    """A DynamicCache holding keys and values in one dtype. Under bf16 (fp16) autocast the rotary
    embedding's fp32 cos and sin make the keys fp32, which the plain cache keeps, half as large
    again; attention reads them as bf16 (fp16) anyway, so storing them so changes nothing it
    computes."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.store_dtype = dtype

    @classmethod
    def for_model(cls, model) -> "KVCache":
        """In the dtype attention reads: autocast's on the model's device (bf16, fp16), else the
        model's own."""
        device = next(model.parameters()).device.type
        if torch.is_autocast_enabled(device):
            return cls(torch.get_autocast_dtype(device))
        return cls(next(model.parameters()).dtype)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = key_states.to(self.store_dtype), value_states.to(self.store_dtype)
        return super().update(keys, values, layer_idx, *args, **kwargs)


def cache_argument(model, cache: DynamicCache) -> dict:
    """forward's keyword for a KV cache: transformers 5.2x renamed past_key_values to cache, and
    the 5.1x release vLLM pins has only the old name."""
    plain = model.get_base_model() if lora.is_adapted(model) else model  # PEFT's takes **kwargs
    new = "cache" in inspect.signature(plain.forward).parameters
    return {"cache" if new else "past_key_values": cache}


def enable_checkpointing(model) -> None:
    """Activation (gradient) checkpointing. transformers renamed gradient_checkpointing_enable to
    activation_checkpointing_enable, warning on the old name; older 5.x releases (vLLM pins one)
    have only the old name."""
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()


def resolve_device(requested: str, gpu_recipe: str = "") -> torch.device:
    """auto is cuda where there is a GPU; a GPU recipe without one stops with the fix."""
    if requested == "auto":
        if gpu_recipe and not torch.cuda.is_available():
            raise SystemExit(
                f"error: --preset {gpu_recipe} is a GPU recipe and no CUDA GPU was "
                f"found; run the CPU demo with --preset tiny (or force --device cpu)"
            )
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU was found; use --device cpu")
    return torch.device(requested)
