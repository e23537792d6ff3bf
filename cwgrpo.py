"""cwgrpo.py: CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage
Reweighting", Wang et al., ACL 2026) and the token-weighting methods it is compared with, in one
file that reads like the paper: 1 config, 2 data, 3 reward, 4 sampling, 5 log-probs, 6 group
advantages, 7 the methods, 8 the loss, 9 the training loop. docs/math.md has every formula.

    python cwgrpo.py --method cw --preset tiny   # CW-GRPO on a tiny model, in a minute on a CPU
    python cwgrpo.py --method cw                 # the paper's 1.5B recipe (one CUDA GPU)
"""

import sys
from dataclasses import dataclass
from typing import Literal

from cwgrpo_utils import BASES, REPOSITORY, SMOLLM2, cli, trackers
from cwgrpo_utils.cli import arg

# 1. Config --------------------------------------------------------------------------------------
# The system prompt Open-RS trains with (the paper's training data).
OPEN_RS_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves "
    "it. The assistant first thinks about the reasoning process in the mind and then provides the "
    "user with the answer, and put your final answer within \\boxed{} . The reasoning process and "
    "answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>. Note that respond by "
    "English, NOT use other languages."
)
# Each recipe's values; the Config defaults are the paper's 1.5B one (docs/math.md, "Recipe")
PRESETS = {
    "paper-1.5b": {},
    # Qwen2.5-Math-7B has 4,096 positions: prompt + completion fit in them with --length-limit total
    "paper-7b": dict(model="Qwen/Qwen2.5-Math-7B-Instruct", format_weight=0.0, steps=150),
    # The 1.5B recipe on one 24 GB card: TRL's quick-start model, 3,072 positions, 4 prompts at once
    "qwen0.5b-24gb": dict(model="Qwen/Qwen2.5-0.5B-Instruct", max_completion_length=3072)
    | dict(rollout_chunk=4),
}
# tiny: a model and task of cwgrpo_utils/tiny.py, built in the clone on first use; tiny-chain: the
# same model on four digits summed step by step, three decisions a completion
TINY = dict(system_prompt="", group_size=8, prompts_per_step=8, groups_per_micro_batch=0, seed=0)
TINY |= dict(max_prompt_length=64, length_limit="new", temperature=1.0, learning_rate=7e-4)
TINY |= dict(warmup_ratio=0.05, steps=200, save_every=50, gradient_checkpointing=False)
for preset, length in (("tiny", 40), ("tiny-chain", 64)):
    PRESETS[preset] = TINY | dict(model=f"{BASES[preset]}/model", max_completion_length=length)
    PRESETS[preset] |= dict(dataset=f"{BASES[preset]}/arithmetic.jsonl")
# A real LM on the CPU (cwgrpo_utils/smollm2.py): it writes no think tags, so only accuracy counts
SUMS = dict(model=SMOLLM2, dataset=f"{BASES['smollm2-sums']}/sums.jsonl", format_weight=0.0)
SUMS |= dict(prompts_per_step=2, max_prompt_length=128, max_completion_length=48, steps=12)
PRESETS["smollm2-sums"] = TINY | SUMS | dict(temperature=0.7, learning_rate=2e-5, save_every=10)
# LoRA on every linear layer at 10x full fine-tuning's learning rate ("LoRA Without Regret")
LORA = dict(lora_rank=32, learning_rate=1e-5)
# The paper's model and recipe on one 24 GB card: LoRA, 3,072 positions, 4 prompts sampled at once
PRESETS["paper-1.5b-lora-24gb"] = LORA | dict(max_completion_length=3072, rollout_chunk=4)
PRESETS["paper-7b-lora-80gb"] = PRESETS["paper-7b"] | LORA  # Qwen2.5-Math-7B on one 80 GB card
# The options each method of section 7 reads; its keys are the --method choices
METHOD_OPTIONS = {"grpo": (), "cw": ("cw_norm", "cw_detach", "cw_reading")}
METHOD_OPTIONS |= {"clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")}
METHOD_OPTIONS |= {"kl_cov": ("kl_cov_ratio", "kl_cov_coef"), "ar": ("ar_alpha",)}
METHOD_OPTIONS |= {"lopti": ("lopti_eta",), "ar_lopti": ("ar_lopti_alpha", "ar_lopti_eta")}
METHOD_OPTIONS |= {"ict": ("ict_keep_frac",), "entropy20": ("entropy_top_frac",)}
METHOD_OPTIONS |= {"stapo": ("stapo_max_prob", "stapo_entropy_percentile")}
# What each --cw-reading means; gradient-only: w = 1 in value, with the released weights' gradient
CW_READINGS = {"released": dict(cw_norm="padded", cw_detach=False)}
CW_READINGS |= {"paper": dict(cw_norm="valid", cw_detach=True)}
CW_READINGS |= {"gradient-only": CW_READINGS["released"]}
CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean")


@dataclass
class Config:
    """The defaults are the released 1.5B recipe (docs/math.md, "Recipe"); PRESETS override some.
    --help shows the defaults of the --preset given (paper-1.5b when none is)."""

    preset: Literal[tuple(PRESETS)] = arg("paper-1.5b", "a recipe whose values are the defaults")
    method: Literal[tuple(METHOD_OPTIONS)] = arg("cw", "token-weighting method (section 7)")
    model: str = arg("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "hub id or local folder")
    dataset: str = arg("knoveleng/open-rs", "hub id or local .json/.jsonl/.parquet/.csv file")
    dataset_split: str = arg("train", "split of a hub dataset")
    question_column: str = arg("problem", "column of the question")
    gold_column: str = arg("solution", "column of the reference solution (parsed by math-verify)")
    system_prompt: str = arg(OPEN_RS_SYSTEM_PROMPT, "system message; empty: none of ours")
    group_size: int = arg(12, "G, completions sampled per prompt", ">= 2")
    prompts_per_step: int = arg(12, "prompts per rollout batch", "> 0")
    groups_per_micro_batch: int = arg(1, "whole groups per forward/backward; 0: all", ">= 0")
    max_prompt_length: int = arg(512, "longer prompts are skipped (and counted)", "> 0")
    max_completion_length: int = arg(4096, "generation limit; see --length-limit", "> 0")
    length_limit: Literal["total", "new"] = arg("total", "of prompt + completion, or new tokens")
    rollout: Literal["hf", "vllm"] = arg("hf", "sampler: hf (section 4's loop) or vllm")
    vllm_gpu_memory_utilization: float = arg(0.3, "vllm on CUDA: its share of the GPU", "in (0, 1]")
    temperature: float = arg(0.7, "sampling temperature; log-probs use it too", "> 0")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 is off (paper)", "in (0, 1]")
    top_k: int = arg(0, "top-k sampling; 0 is off (paper)", ">= 0")
    mask_truncated_completions: bool = arg(False, "drop completions cut at the limit from the loss")
    accuracy_weight: float = arg(1.0, "weight of the accuracy reward", ">= 0")
    format_weight: float = arg(1.0, "weight of the format reward", ">= 0")
    reward_timeout_s: float = arg(10.0, "hard limit on grading one completion", "> 0")
    reward_workers: int = arg(0, "grading processes; 0: one per core, at most 8", ">= 0")
    beta: float = arg(0.04, "k3 KL coefficient; 0 loads no reference model", ">= 0")
    eps_low: float = arg(0.2, "PPO clip range below 1", ">= 0")
    eps_high: float = arg(0.2, "PPO clip range above 1", ">= 0")
    sampler_correction: Literal[CORRECTIONS] = arg("none", "for the sampler-trainer mismatch")
    sampler_correction_cap: float = arg(3.0, "C: truncate the ratio at it, or mask above it", "> 0")
    sampler_correction_min: float = arg(0.0, "C_min: *_mask also masks ratios below it", ">= 0")
    loss_aggregation: Literal[AGGREGATIONS] = arg(AGGREGATIONS[0], "GRPO's (paper), or DAPO's")
    num_iterations: int = arg(1, "policy updates per rollout batch (paper: 1)", "> 0")
    cw_norm: Literal["padded", "valid"] = arg("padded", "cw: mean 1 over padded or real tokens")
    cw_detach: bool = arg(False, "cw: no gradient through the weights (released code: it flows)")
    cw_reading: Literal[tuple(CW_READINGS)] = arg("released", "cw: a reading (CW_READINGS)")
    clip_cov_ratio: float = arg(2e-4, "clip_cov: share of tokens zeroed", "in (0, 1]")
    clip_cov_lb: float = arg(1.0, "clip_cov: candidates have covariance above this")
    clip_cov_ub: float = arg(5.0, "clip_cov: candidates have covariance below this")
    kl_cov_ratio: float = arg(2e-3, "kl_cov: share of tokens penalised", "in (0, 1]")
    kl_cov_coef: float = arg(1.0, "kl_cov: coefficient of |logp - old_logp|", ">= 0")
    ar_alpha: float = arg(0.2, "ar: alpha of w = alpha p + 1 - alpha", "in [0, 1]")
    lopti_eta: float = arg(0.4, "lopti: probability threshold of the first pass", "in (0, 1]")
    ar_lopti_alpha: float = arg(0.3, "ar_lopti: ar's alpha", "in [0, 1]")
    ar_lopti_eta: float = arg(0.5, "ar_lopti: lopti's eta", "in (0, 1]")
    ict_keep_frac: float = arg(0.1, "ict: share of positions kept", "in (0, 1]")
    entropy_top_frac: float = arg(0.2, "entropy20: share of tokens kept", "in (0, 1]")
    stapo_max_prob: float = arg(0.01, "stapo: silence tokens with p below this ...", ">= 0")
    stapo_entropy_percentile: float = arg(5.0, "... and entropy below this pct", "in [0, 100]")
    learning_rate: float = arg(1e-6, "peak AdamW learning rate", "> 0")
    min_lr_ratio: float = arg(0.1, "the cosine schedule ends at this x peak", "in [0, 1]")
    warmup_ratio: float = arg(0.1, "share of steps with linear warmup", "in [0, 1]")
    weight_decay: float = arg(0.0, "AdamW weight decay", ">= 0")
    max_grad_norm: float = arg(1.0, "gradient clipping norm", "> 0")
    lora_rank: int = arg(0, "LoRA rank r; 0: full fine-tuning, as the paper", ">= 0")
    lora_alpha: float = arg(32.0, "LoRA: the adapter's update is scaled by alpha / r", "> 0")
    lora_target_modules: str = arg("all-linear", "LoRA: the layers it adapts, comma-separated")
    report_to: list[str] = arg(["none"], "none, or trackers: tensorboard wandb trackio")
    steps: int = arg(300, "rollout batches to train on", "> 0")
    save_every: int = arg(50, "write checkpoint-<step> this often", "> 0")
    seed: int = arg(2025, "seed of data order and sampling", ">= 0")
    gradient_checkpointing: bool = arg(True, "recompute activations in backward to save memory")
    logit_chunk_elements: int = arg(2**26, "logits the LM head holds at once", "> 0")
    device: str = arg("auto", "auto (cuda if present), cuda or cpu")
    threads: int = arg(0, "CPU threads of torch; 0: torch's default", ">= 0")
    output_dir: str = arg("", "default runs/<method>-<preset>-seed<seed>")
    resume: bool = arg(False, "continue from the newest complete checkpoint in --output-dir")
    overwrite_output_dir: bool = arg(False, "start afresh in an --output-dir that holds a run")
    log_every: int = arg(10, "without a terminal, a progress line every this many steps", "> 0")
    rollout_chunk: int = arg(0, "prompts sampled at once (bounds the KV cache); 0: all", ">= 0")
    save_total_limit: int = arg(0, "keep only the newest this many checkpoints; 0: all", ">= 0")
    plan: bool = arg(False, "print the memory and disk plan (cwgrpo_utils/memory_plan.py), exit")

    def __post_init__(self):
        """Every value is checked here, at parse time, before any slow work."""
        cli.check_ranges(self)
        lb, ub = self.clip_cov_lb, self.clip_cov_ub
        cli.check(lb < ub, f"--clip-cov-lb ({lb}) must be below --clip-cov-ub ({ub})")
        g, m = self.prompts_per_step, self.groups_per_micro_batch
        many = f"--prompts-per-step ({g}) must be a multiple of --groups-per-micro-batch ({m})"
        cli.check(g % (m or g) == 0, many)
        prompt, limit = self.max_prompt_length, self.max_completion_length
        room = f"--max-prompt-length ({prompt}) leaves no room for a completion within "
        room += f"--max-completion-length ({limit}) under --length-limit total"
        cli.check(self.length_limit == "new" or prompt < limit, room)
        if self.cw_reading != "released":  # a reading names both choices (parse_config checks)
            self.cw_norm, self.cw_detach = CW_READINGS[self.cw_reading].values()
        self.output_dir = self.output_dir or f"runs/{self.method}-{self.preset}-seed{self.seed}"


def parse_config(argv=None, *extra, hidden: tuple = (), prog: str | None = None):
    """The run's Config (and those of extra dataclasses a tool adds): the --preset's values as
    defaults, then the command line; `hidden` options are left out of a tool's --help."""
    argv, about = sys.argv[1:] if argv is None else list(argv), __doc__.split("\n\n")[0]
    types, named = (Config, *extra), dict(description=about, prog=prog)
    parsed, given = cli.parse_dataclasses(types, argv, PRESETS, hidden, **named)
    cfg = parsed[0]
    cli.check_implied(given, "cw_reading", CW_READINGS)  # a reading names both choices
    cli.note_unused(given, "method", cfg.method, METHOD_OPTIONS)
    if cfg.method == "kl_cov" and cfg.num_iterations == 1:
        note = "note: kl_cov's |logp - old_logp| is 0 with one update per batch: it trains as GRPO"
        cli.warn_once(note, note + "; use --num-iterations 2")
    if cfg.rollout == "vllm" and not cfg.plan:  # a plan needs no engine
        cli.require("vllm", "--rollout vllm")
    trackers.check(cfg.report_to)
    return parsed if extra else cfg


if __name__ == "__main__":  # --help and a bad option answer here, before the heavy imports below
    CONFIG = parse_config()

# What a run needs once its command line is known (pyproject.toml lets these follow section 1)
import dataclasses
import functools
import math
import os
import random
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import transformers
from latex2sympy2_extended import NormalizationConfig
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from cwgrpo_utils import checkpoints, loading, lora, memory_plan, plots, presets, tiny, token_page
from cwgrpo_utils.grading_pool import CachedTimeoutPool, LogCounter
from cwgrpo_utils.lm_head import chunked_logprobs, ict_divergence
from cwgrpo_utils.run_folder import Progress, RunFolder, never_fatal, update_metrics
from cwgrpo_utils.vllm_engine import Engine


# 2. Data and prompts ----------------------------------------------------------------------------
def chat_prompt_ids(tokenizer, question: str, system_prompt: str) -> list[int]:
    """A question as the model's chat template writes it, ready for the assistant's answer."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    template = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return template["input_ids"]


class PromptStream:
    """(prompt ids, gold) pairs in a seeded order reshuffled each epoch, those over
    --max-prompt-length skipped; its position (prompts served) is all a checkpoint needs."""

    def __init__(self, dataset, tokenizer, cfg: Config):
        loading.note_template_system_prompt(tokenizer, cfg.system_prompt)  # SmolLM2's: its own
        rows = zip(dataset[cfg.question_column], dataset[cfg.gold_column])
        pairs = [(chat_prompt_ids(tokenizer, str(q), cfg.system_prompt), str(g)) for q, g in rows]
        self.items = [(ids, gold) for ids, gold in pairs if len(ids) <= cfg.max_prompt_length]
        self.skipped, self.seed, self.position = len(pairs) - len(self.items), cfg.seed, 0
        if self.skipped:
            print(f"skipped {self.skipped} prompts longer than --max-prompt-length")
        too_long = f"every prompt is longer than --max-prompt-length {cfg.max_prompt_length}"
        cli.check(self.items, too_long)

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


# 3. Reward: math-verify accuracy + format (docs/math.md, "Reward") ------------------------------
class Grade(NamedTuple):
    accuracy: float
    gold_parsed: bool  # False: the gold could not be parsed, so the score is 0 by rule
    timed_out: bool  # grading was cut off (ours or math-verify's own limit), so the score is 0


GOLD_EXTRACTION = {"default": [LatexExtractionConfig(), ExprExtractionConfig()]}
GOLD_EXTRACTION |= {"expr": [ExprExtractionConfig()], "latex": [LatexExtractionConfig()]}
RELEASED_NORMALISATION = NormalizationConfig(basic_latex=True, units=True, boxed="all")  # rest off
# No match without an anchor, \\boxed{} first (priority 0), the released normalisation
PREDICTION_EXTRACTION = [LatexExtractionConfig(False, 0, RELEASED_NORMALISATION)]


def grade_accuracy(completion: str, gold: str, gold_format: str = "default") -> Grade:
    """1.0 if math-verify finds the completion's answer equal to the gold, checked gold first
    (verify is not symmetric). gold_format "default" is math-verify's default extraction, the
    training reward's; evaluate.py's benchmarks parse their gold as "expr" or "latex".
    math-verify's own cutoffs (5 s a parse or comparison) score 0 and count as cutoffs."""
    cutoffs = LogCounter.installed("math_verify", "Timeout during")
    before = cutoffs.count
    try:
        gold_parsed = parse(gold, GOLD_EXTRACTION[gold_format], extraction_mode="first_match")
        if not gold_parsed:
            return Grade(0.0, False, False)
        prediction = parse(completion, PREDICTION_EXTRACTION, extraction_mode="first_match")
        accuracy = float(verify(gold_parsed, prediction))
    except Exception:  # noqa: BLE001 - a failure inside the grader is a wrong answer
        accuracy = 0.0
    return Grade(accuracy, True, cutoffs.count > before)


def format_reward(completion: str) -> float:
    return float(completion.count("\n</think>\n") == 1)


class Grader(CachedTimeoutPool):
    """grade_accuracy in worker processes under a hard time limit (cwgrpo_utils/grading_pool.py),
    cached since grading is pure; workers 0: one per core, at most 8."""

    def __init__(self, timeout_s: float = 10.0, workers: int = 1):
        workers = workers or min(8, os.cpu_count() or 1)
        super().__init__(grade_accuracy, workers, timeout_s, Grade(0.0, True, True))

    def grade(self, completion: str, gold: str, gold_format: str = "default") -> Grade:
        return self.map([(completion, gold, gold_format)])[0]


# 4. Sampling ------------------------------------------------------------------------------------
# The (N, T) tensors of a Rollout, one value per completion token
PER_TOKEN = ("completion_ids", "completion_mask", "old_logp", "entropy", "divergence", "ref_logp")
PER_TOKEN += ("active", "sampler_logp")


@dataclass
class Rollout:
    """One rollout batch: N = prompts x G completions, consecutive rows forming a group."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T) float, 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool, no EOS within the limit
    texts: list
    sampler_logp: torch.Tensor  # (N, T) log-probs of the sampled tokens by the sampler's kernels
    golds: list = None
    rewards: torch.Tensor = None  # (N,)
    accuracy: torch.Tensor = None  # (N,) 1 where math-verify finds the answer right
    advantages: torch.Tensor = None  # (N,)
    # From a no-grad pass after sampling, when the update needs them (num_iterations > 1, or the
    # method asks); otherwise old == current (detached) and the update's own entropy is used.
    old_logp: torch.Tensor = None  # (N, T)
    entropy: torch.Tensor = None  # (N, T)
    divergence: torch.Tensor = None  # (N, T) ict's score
    ref_logp: torch.Tensor = None  # (N, T) only when beta > 0
    active: torch.Tensor = None  # (N, T) tokens whose loss counts; all when None (diagnostics)
    batch_entropy: torch.Tensor = None  # the sorted entropies of all the batch's valid tokens

    def select(self, start: int, stop: int) -> "Rollout":
        """Rows [start, stop), with their all-padding columns trimmed off."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in out.items():
            if value is not None and name != "batch_entropy":  # the batch's, not a row's
                out[name] = value[start:stop]
        first_prompt_column = out["prompt_mask"].any(0).nonzero()[0, 0]
        completion_len = int(out["completion_mask"].sum(1).max())
        for name in ("prompt_ids", "prompt_mask"):
            out[name] = out[name][:, first_prompt_column:]
        for name in (n for n in PER_TOKEN if out[n] is not None):
            out[name] = out[name][:, :completion_len]
        return Rollout(**out)

    def micro_batches(self, cfg: Config):
        """(block, part) for each micro-batch of whole groups: the part's rows with padding
        columns trimmed, and the (rows, columns) block of this batch's (N, T) tensors it fills."""
        rows = (cfg.groups_per_micro_batch or cfg.prompts_per_step) * cfg.group_size
        for start in range(0, len(self.texts), rows):
            part = self.select(start, start + rows)
            yield (slice(start, start + rows), slice(0, part.completion_ids.shape[1])), part


class Sampling(NamedTuple):
    """How completions are drawn: n of each prompt from softmax(logits / temperature), cut to the
    top_k tokens and the top_p nucleus where set (0 and 1: off), each at most max_new_tokens long
    or, with max_total, at most max_total tokens with its prompt (as vLLM's max model length)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    max_total: int | None = None


@torch.no_grad()
def sample(model, tokenizer, batch: list[tuple[list[int], str]], cfg: Config, engine=None):
    """G completions per prompt, by the token loop below or, given one, a vLLM engine that
    samples from `model`'s weights."""
    model.eval()
    limit = cfg.max_completion_length
    total = limit if cfg.length_limit == "total" else None
    how = Sampling(cfg.group_size, cfg.temperature, cfg.top_p, cfg.top_k, limit, total)
    prompts = [ids for ids, _ in batch]
    rollout = generate_completions(model, tokenizer, prompts, how, cfg.rollout_chunk, engine)
    rollout.golds = [gold for _, gold in batch for _ in range(cfg.group_size)]
    if cfg.mask_truncated_completions:  # out of the loss, not out of the reward
        rollout.completion_mask = rollout.completion_mask * (~rollout.truncated)[:, None]
    return rollout


@torch.no_grad()
def generate_completions(model, tokenizer, prompts, how: Sampling, chunk=0, engine=None):
    """how.n completions of each prompt as one Rollout. With chunk, that many prompts are sampled
    at a time, which bounds the KV cache. With an engine, vLLM samples (model None: an engine
    with weights of its own, evaluate.py's)."""
    eos = (model or engine).generation_config.eos_token_id  # the tokens a completion ends at
    eos = [eos] if isinstance(eos, int) else list(eos or []) or [tokenizer.eos_token_id]
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    width, n, pad = max(map(len, prompts)), how.n, tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    prompt_ids = prompt_ids.repeat_interleave(n, 0)  # (N, P): n rows per prompt, left-padded
    prompt_mask = prompt_mask.to(device).repeat_interleave(n, 0)
    limits = [how.max_total - len(p) if how.max_total else how.max_new_tokens for p in prompts]
    row_limits = torch.tensor(limits, device=device).repeat_interleave(n)  # (N,)
    if engine is not None:
        ids, logp = engine.generate(model, prompts, *how[:4], limits, eos, pad)
    else:
        chunked = (prompt_ids, prompt_mask, row_limits, how, n * (chunk or len(prompts)))
        ids, logp = sample_in_chunks(model, *chunked, eos, pad)
    ids, logp = ids.to(device), logp.to(device)  # (N, T), right-padded
    # each row's mask holds its tokens up to and including the first EOS within its limit
    positions = torch.arange(ids.shape[1], device=device)
    is_eos = torch.isin(ids, torch.tensor(eos, device=device)) & (positions < row_limits[:, None])
    truncated = ~is_eos.any(1)
    last = torch.where(truncated, row_limits - 1, is_eos.int().argmax(1))
    mask = (positions[None, :] <= last[:, None]).float()  # (N, T)
    rows = [row[:k] for row, k in zip(ids.tolist(), mask.sum(1).long().tolist())]
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, ids, mask, truncated, texts, logp * mask)


def sample_in_chunks(model, prompt_ids, prompt_mask, limits, how: Sampling, rows, eos, pad):
    """sample_tokens on `rows` rows at a time, each chunk with only its own left padding and for
    at most its own longest limit, as if sampled alone; right-padded into one (N, T) batch."""
    parts = []
    for i in range(0, len(prompt_ids), rows):
        mask, steps = prompt_mask[i : i + rows], int(limits[i : i + rows].max())
        first = int(mask.any(0).nonzero()[0, 0])  # the chunk's own widest prompt starts here
        ids, mask = prompt_ids[i : i + rows, first:], mask[:, first:]
        parts.append(sample_tokens(model, ids, mask, how, steps, eos, pad))
    width = max(ids.shape[1] for ids, _ in parts)
    ids = torch.cat([F.pad(ids, (0, width - ids.shape[1]), value=pad) for ids, _ in parts])
    return ids, torch.cat([F.pad(logp, (0, width - logp.shape[1])) for _, logp in parts])


@torch.no_grad()
def sample_tokens(model, prompt_ids, prompt_mask, how: Sampling, steps: int, eos, pad, cache=None):
    """Autoregressive sampling with a KV cache for `steps` tokens at most, rows stopping at an EOS
    id. Only the temperature and the cuts shape the distribution, so the tokens come from the one
    whose log-probs the loss uses: generate() would add what the model's generation_config.json
    ships (a repetition penalty, say). The (B, T) tokens and their log-probs, 0 after an EOS."""
    attention = prompt_mask.clone()
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # left padding: count real tokens only
    # = DynamicCache(), keeping keys and values in bf16 under CUDA autocast (loading.py)
    cache = loading.KVCache.for_model(model) if cache is None else cache  # a caller's: inspect
    input_ids, tokens, logps = prompt_ids, [], []
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)  # (B,)
    eos = torch.tensor(eos, device=prompt_ids.device)
    cache_argument = loading.cache_argument(model, cache)  # {"cache": cache}, by version
    for step in range(steps):
        logits = model(
            input_ids=input_ids,
            attention_mask=loading.attention_mask(model, attention) if step == 0 else attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_argument,
        ).logits[:, -1]  # (B, vocab): the next token's
        probs = (logits.float() / how.temperature).softmax(-1)
        if how.top_k:
            probs = probs * (probs >= probs.topk(how.top_k, -1).values[:, -1:])
        if how.top_p < 1:  # keep the most probable tokens until their mass reaches top_p
            sorted_probs, order = probs.sort(-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= how.top_p * probs.sum(-1, True)
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
        cdf = probs.cumsum(-1)  # inverse-CDF draw: much cheaper than torch.multinomial on CPU
        token = torch.searchsorted(cdf, torch.rand_like(cdf[:, :1]) * cdf[:, -1:]).squeeze(1)
        token = token.clamp(max=probs.shape[-1] - 1).masked_fill(finished, pad)  # (B,)
        drawn = probs.gather(1, token[:, None]).squeeze(1) / cdf[:, -1]
        tokens.append(token)
        logps.append(drawn.log().masked_fill(finished, 0))
        finished |= torch.isin(token, eos)
        if finished.all():
            break
        input_ids, positions = token[:, None], positions[:, -1:] + 1
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
    return torch.stack(tokens, 1), torch.stack(logps, 1)


# 5. Log-probs and entropy, chunked over positions -----------------------------------------------
def completion_logprobs(model, rollout: Rollout, cfg: Config):
    """(N, T) log-probs of the sampled completion tokens and the entropies there, 0 on padding;
    and the (N, T, hidden) states that predict them."""
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention_mask_2d = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
    position_ids = (attention_mask_2d.cumsum(1) - 1).clamp(min=0)  # as in sampling
    # = attention_mask_2d, as a mask no fully padded query row can turn into NaN (loading.py)
    mask = loading.attention_mask(model, attention_mask_2d)
    inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    prompt_width = rollout.prompt_ids.shape[1]
    hidden = hidden[:, prompt_width - 1 : -1]  # the state at position t predicts completion token t
    valid = rollout.completion_mask.bool()
    head, targets = model.get_output_embeddings().weight, rollout.completion_ids[valid]
    # = log_softmax(hidden @ head.T / T).gather(targets) and its entropy, a chunk of positions at
    # a time, never holding vocab x length logits (cwgrpo_utils/lm_head.py)
    chunking = (cfg.temperature, cfg.logit_chunk_elements)
    logp_valid, entropy_valid = chunked_logprobs(hidden[valid], head, targets, *chunking)
    logp = torch.zeros(valid.shape, device=hidden.device, dtype=logp_valid.dtype)
    entropy = torch.zeros_like(logp)
    logp[valid], entropy[valid] = logp_valid, entropy_valid
    return logp, entropy, hidden


@torch.no_grad()
def policy_token_stats(model, rollout: Rollout, cfg: Config, divergence: bool = False) -> dict:
    """(N, T) log-probs and entropies of the batch's tokens under `model` (policy or reference),
    without gradient, and ict's divergence on request; 0 on padding."""
    names = ["logp", "entropy"] + ["divergence"] * divergence
    out = {name: torch.zeros_like(rollout.completion_mask) for name in names}
    for block, part in rollout.micro_batches(cfg):
        out["logp"][block], out["entropy"][block], hidden = completion_logprobs(model, part, cfg)
        if divergence:  # = JS(p[i,t] || mean of the group's p[., t]), streamed (lm_head.py)
            head, mask = model.get_output_embeddings().weight, part.completion_mask
            chunking = (cfg.temperature, cfg.logit_chunk_elements, cfg.group_size)
            out["divergence"][block] = ict_divergence(hidden, head, mask, *chunking)
    return out


# 6. Group advantages ----------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + 1e-4) within each group, Bessel std (GRPO; math.md)."""
    groups = rewards.view(-1, group_size)  # (prompts, G)
    advantages = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    return advantages.view(-1)


def rollout_rewards(rollout: Rollout, grades: list[Grade], cfg: Config) -> dict:
    """Sets the batch's rewards and group advantages; returns the rollout's metrics."""
    accuracy = torch.tensor([g.accuracy for g in grades])
    formats = torch.tensor([format_reward(text) for text in rollout.texts])
    rollout.rewards = cfg.accuracy_weight * accuracy + cfg.format_weight * formats
    rollout.accuracy = accuracy
    advantages = group_advantages(rollout.rewards, cfg.group_size)
    rollout.advantages = advantages.to(rollout.completion_ids.device)
    group_std = rollout.rewards.view(-1, cfg.group_size).std(1)
    metrics = {
        "reward_mean": rollout.rewards.mean().item(),
        "reward_std": rollout.rewards.std().item(),
        "accuracy_mean": accuracy.mean().item(),
        "format_mean": formats.mean().item(),
        "frac_zero_std_groups": (group_std == 0).float().mean().item(),
        "completion_len_mean": rollout.completion_mask.sum(1).mean().item(),
        "truncated_frac": rollout.truncated.float().mean().item(),
        "gold_unparseable": sum(not g.gold_parsed for g in grades),
        "grading_timeouts": sum(g.timed_out for g in grades),
    }
    plots.warn_of_grading_problems(metrics)  # each scored 0: said once, summed at the end
    return metrics


# 7. The methods: how each one changes the per-token loss (docs/math.md, "Methods") --------------
class Group(NamedTuple):
    """What a method sees of one group of G responses (T = the micro-batch's longest response)."""

    logp: torch.Tensor  # (G, T) current policy, with gradient
    old_logp: torch.Tensor  # (G, T) rollout policy, no gradient
    advantages: torch.Tensor  # (G,)
    mask: torch.Tensor  # (G, T) 0/1
    entropy: torch.Tensor  # (G, T) rollout policy's entropy, no gradient
    batch_entropy: torch.Tensor | None  # sorted entropies of the batch's valid tokens
    divergence: torch.Tensor | None  # (G, T) ict's JS score, for the methods that ask for it
    update_pass: int  # 0; lopti's second (high-probability) pass is 1


class TokenTerms(NamedTuple):
    """How a method changes the per-token loss w * pg + beta * k3."""

    pg_weight: torch.Tensor  # w (G, T); 0 drops a token's PG term, not its share of the denominator
    extra: torch.Tensor | None = None  # (G, T) a per-token term added to the loss (kl_cov)
    active: torch.Tensor | None = None  # (G, T) tokens whose PG and KL terms count in this pass


def grpo(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(group.mask)  # w = 1 (Shao et al. 2024)


def covariance_score(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CW-GRPO's per-token covariance score of one group (math.md "cw", steps 1-3)."""
    mu = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)  # 1. each response's mean log-prob (G,)
    centred_adv = adv - adv.mean()  # 2. (G,)
    return (logp - mu[:, None]) * centred_adv[:, None] * mask  # 3. (G, T)


def cw_weights(logp, adv, mask, *, norm: str = "padded", detach: bool = False) -> torch.Tensor:
    """CW-GRPO's weights of one group (Wang et al. 2026, method; docs/math.md "cw", steps 1-8)."""
    score = covariance_score(logp, adv, mask)  # 1-3. (G, T)
    n_valid = mask.sum().clamp(min=1)  # a group with no valid token gets weights 0, not NaN
    score_mean = score.sum() / n_valid
    variance = ((score - score_mean) ** 2 * mask).sum() / n_valid  # 4. ddof=0
    # sqrt'(0) is infinite: when every score is 0 (equal rewards) sigma = 1e-8 with zero gradient
    sigma = torch.where(variance > 0, variance, 1.0).sqrt() * (variance > 0) + 1e-8
    kernel = torch.exp(-(score**2) / (2 * sigma**2)) * mask  # 5.
    if norm == "padded":  # 6. released code
        total = mask.shape[0] * mask.sum(1).max()
    elif norm == "valid":  # 6. paper wording
        total = n_valid
    else:
        raise ValueError(f"cw_weights: norm must be 'padded' or 'valid', got {norm!r}")
    weights = kernel * total / kernel.sum().clamp(min=1e-30)
    return weights.detach() if detach else weights  # 7.


def cw(group: Group, cfg: Config) -> TokenTerms:
    reading = dict(norm=cfg.cw_norm, detach=cfg.cw_detach)
    weights = cw_weights(group.logp, group.advantages, group.mask, **reading)
    if cfg.cw_reading == "gradient-only":  # value exactly 1, gradient that of the weights
        weights = group.mask + (weights - weights.detach())
    return TokenTerms(weights)


def token_covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cui et al.'s C = (logp - mean logp) (A - mean A), means over the valid tokens (math.md)."""
    logp, adv = logp.detach(), adv[:, None].expand_as(logp)
    n_valid = mask.sum().clamp(min=1)
    return (logp - (logp * mask).sum() / n_valid) * (adv - (adv * mask).sum() / n_valid) * mask


def ppo_clipped(ratio: torch.Tensor, adv: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Tokens whose PG term PPO's clip holds constant (no gradient)."""
    low, high = (ratio < 1 - cfg.eps_low) & (adv[:, None] < 0), ratio > 1 + cfg.eps_high
    return low | (high & (adv[:, None] > 0))


def clip_cov(group: Group, cfg: Config) -> TokenTerms:
    """Clip-Cov (Cui et al. 2025): zero the loss of a few random tokens with lb < C < ub."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    ratio = torch.exp(group.logp.detach() - group.old_logp)
    candidates = (group.mask > 0) & ~ppo_clipped(ratio, group.advantages, cfg)
    candidates &= (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    n_select = max(int(cfg.clip_cov_ratio * group.mask.sum()), 1)
    positions = candidates.nonzero()
    chosen = positions[torch.randperm(len(positions), device=positions.device)[:n_select]]
    weight = group.mask.clone()
    weight[chosen[:, 0], chosen[:, 1]] = 0
    return TokenTerms(weight)


def kl_cov(group: Group, cfg: Config) -> TokenTerms:
    """KL-Cov (Cui et al. 2025): no clipping; |logp - old_logp| on the top-k tokens by C."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    n_valid = int(group.mask.sum())  # k: at least 1, at most the valid tokens (0 in an empty group)
    k = min(max(1, int(cfg.kl_cov_ratio * n_valid)), n_valid)
    top = torch.zeros_like(group.mask, dtype=torch.bool).view(-1)
    top[cov.masked_fill(group.mask == 0, -torch.inf).view(-1).topk(k).indices] = True
    extra = cfg.kl_cov_coef * (group.logp - group.old_logp).abs() * top.view_as(group.mask)
    return TokenTerms(group.mask, extra=extra)


def ar(group: Group, cfg: Config, alpha: float | None = None) -> TokenTerms:
    """Advantage reweighting (Yang et al. 2025, Eq. 4): w = alpha p_old + 1 - alpha, constant."""
    alpha = cfg.ar_alpha if alpha is None else alpha
    return TokenTerms((alpha * group.old_logp.exp() + 1 - alpha) * group.mask)


def lopti(group: Group, cfg: Config, eta: float | None = None, w=None) -> TokenTerms:
    """Lopti (Yang et al. 2025): pass 0 updates the tokens with p_old < eta, pass 1 the rest."""
    low = group.old_logp.exp() < (cfg.lopti_eta if eta is None else eta)
    active = group.mask * (low if group.update_pass == 0 else ~low)
    return TokenTerms(group.mask if w is None else w, active=active)


def ar_lopti(group: Group, cfg: Config) -> TokenTerms:
    return lopti(group, cfg, cfg.ar_lopti_eta, ar(group, cfg, cfg.ar_lopti_alpha).pg_weight)


def renormalised(keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weights that make a response's token mean of the PG term run over its kept tokens only."""
    return keep * mask.sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)


def ict(group: Group, cfg: Config) -> TokenTerms:
    """ICT (Beyond Entropy, 2026): keep each response's top positions by JS divergence."""
    keep_counts = (cfg.ict_keep_frac * group.mask.sum(1)).ceil().clamp(min=1)  # (G,)
    by_divergence = group.divergence.masked_fill(group.mask == 0, -1)
    ranks = by_divergence.argsort(1, descending=True).argsort(1)
    keep = (ranks < keep_counts[:, None]).float() * group.mask
    return TokenTerms(renormalised(keep, group.mask))


def sorted_quantile(sorted_values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile's linear interpolation, on values sorted once per batch."""
    if len(sorted_values) == 0:  # a batch with no valid token: no token passes any threshold
        return torch.tensor(torch.inf)
    position = q * (len(sorted_values) - 1)
    low, high = int(position), min(int(position) + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def entropy20(group: Group, cfg: Config) -> TokenTerms:
    """80/20 (Wang et al. 2025): PG only on tokens at or above the batch's 80th entropy pct."""
    threshold = sorted_quantile(group.batch_entropy, 1 - cfg.entropy_top_frac)
    return TokenTerms(group.mask * (group.entropy >= threshold))


def stapo(group: Group, cfg: Config) -> TokenTerms:
    """STAPO (2026): silence positive-advantage tokens that are rare and low-entropy."""
    threshold = sorted_quantile(group.batch_entropy, cfg.stapo_entropy_percentile / 100)
    spurious = (group.advantages[:, None] > 0) & (group.old_logp.exp() < cfg.stapo_max_prob)
    spurious &= group.entropy < threshold
    return TokenTerms(renormalised(group.mask * ~spurious, group.mask))


class Method(NamedTuple):
    token_terms: Callable[[Group, Config], TokenTerms]
    description: str
    clip: bool = True  # PPO's clipped surrogate (kl_cov: False)
    update_passes: int = 1
    needs_stats: bool = False
    needs_divergence: bool = False


# What some methods need beyond GRPO's single update pass
STATS = dict(needs_stats=True)  # the batch's old log-probs and entropies, before the update
TWO_PASSES = dict(update_passes=2, needs_stats=True)  # a low-probability pass, then the rest
DIVERGENCE = dict(needs_stats=True, needs_divergence=True)  # and ict's divergence in that pass
METHODS = {  # the keys of METHOD_OPTIONS: each method's token terms, what it does, what it needs
    "grpo": Method(grpo, "GRPO baseline, every token weight 1"),
    "cw": Method(cw, "CW-GRPO, Gaussian-kernel covariance weights (Wang et al. 2026)"),
    "clip_cov": Method(clip_cov, "zero a few random high-covariance tokens (Cui et al. 2025)"),
    "kl_cov": Method(kl_cov, "|logp - old_logp| on top-covariance tokens (Cui 2025)", clip=False),
    "ar": Method(ar, "advantage reweighting by alpha p + 1 - alpha (Yang et al. 2025)"),
    "lopti": Method(lopti, "low-probability tokens first, then the rest (Yang 2025)", **TWO_PASSES),
    "ar_lopti": Method(ar_lopti, "ar and lopti together (Yang et al. 2025)", **TWO_PASSES),
    "ict": Method(ict, "PG only on the top-10% positions by JS divergence (2026)", **DIVERGENCE),
    "entropy20": Method(entropy20, "PG only on the top-20% entropy tokens (Wang 2025)", **STATS),
    "stapo": Method(stapo, "silence rare, low-entropy positive tokens (STAPO, 2026)", **STATS),
}


# 8. The loss ------------------------------------------------------------------------------------
def token_loss(logp, old_logp, ref_logp, advantages, terms: TokenTerms, cfg, clip=True, r=None):
    """Per-token loss w pg + beta k3 (+ a method's extra term); the sampler correction r, if any,
    weights the PG term alone (docs/math.md, "Sampler-trainer mismatch"), and nothing the KL."""
    ratio = torch.exp(logp - old_logp)  # rho (N, T): exactly 1 with one update per batch
    adv = advantages[:, None]
    pg = -ratio * adv
    if clip:  # PPO's clipped surrogate
        pg = torch.max(pg, -ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    loss = terms.pg_weight * pg if r is None else terms.pg_weight * pg * r
    if terms.extra is not None:
        loss = loss + terms.extra
    if ref_logp is not None:
        loss = loss + cfg.beta * k3(logp, ref_logp)
    return loss if terms.active is None else loss * terms.active


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    return torch.exp(ref_logp - logp) - (ref_logp - logp) - 1


def aggregate(per_token, mask, mode: str, n_responses: int, n_tokens: int) -> torch.Tensor:
    """The step's loss summed over micro-batches: divide by step-wide totals."""
    if mode == "seq-mean-token-mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_responses
    return (per_token * mask).sum() / n_tokens


def sampler_correction(old_logp, sampler_logp, mask, cfg: Config) -> torch.Tensor | None:
    """The sampler correction r (math.md, "Sampler-trainer mismatch"), as TRL's: exp(l - s) per
    token, or per sequence summed in log space (a long sum neither overflows nor gives 0 x inf);
    truncate: min(r, C); mask: r, but 0 outside [C_min, C]. None: none, the released recipe."""
    if cfg.sampler_correction == "none":
        return None
    log_r = (old_logp - sampler_logp) * mask
    if cfg.sampler_correction.startswith("sequence"):
        log_r = log_r.sum(1, keepdim=True)
    r = log_r.clamp(max=math.log(cfg.sampler_correction_cap)).exp()
    if cfg.sampler_correction.endswith("truncate"):
        return r
    inside = (log_r <= math.log(cfg.sampler_correction_cap)) & (r >= cfg.sampler_correction_min)
    return r * inside


def micro_batch_terms(logp, old_logp, entropy, rollout: Rollout, cfg: Config, update_pass: int):
    """The method's token terms, group by group, side by side over the micro-batch."""
    token_terms, parts = METHODS[cfg.method].token_terms, []
    for g in (slice(i, i + cfg.group_size) for i in range(0, len(logp), cfg.group_size)):
        divergence = None if rollout.divergence is None else rollout.divergence[g]
        adv, mask = rollout.advantages[g], rollout.completion_mask[g]
        stats = (entropy[g], rollout.batch_entropy, divergence, update_pass)
        parts.append(token_terms(Group(logp[g], old_logp[g], adv, mask, *stats), cfg))
    pg_weight, extra, active = (None if v[0] is None else torch.cat(v) for v in zip(*parts))
    if rollout.active is not None:
        active = rollout.active if active is None else rollout.active * active
    return TokenTerms(pg_weight, extra, active)


def micro_batch_loss(model, rollout: Rollout, cfg, n_responses, n_tokens, update_pass: int = 0):
    """The micro-batch's share of the step's loss, and what its metrics read."""
    logp, entropy, _ = completion_logprobs(model, rollout, cfg)
    old_logp = rollout.old_logp if rollout.old_logp is not None else logp.detach()
    entropy = rollout.entropy if rollout.entropy is not None else entropy
    terms = micro_batch_terms(logp, old_logp, entropy, rollout, cfg, update_pass)
    mask, adv, clip = rollout.completion_mask, rollout.advantages, METHODS[cfg.method].clip
    r = sampler_correction(old_logp, rollout.sampler_logp, mask, cfg)
    per_token = token_loss(logp, old_logp, rollout.ref_logp, adv, terms, cfg, clip, r)
    loss = aggregate(per_token, mask, cfg.loss_aggregation, n_responses, n_tokens)
    return loss, (logp.detach(), old_logp, entropy, terms)


def token_metrics(logp, old_logp, ref_logp, entropy, adv, mask, sampler_logp, terms, cfg):
    """Per valid token, what an update's metrics average (run_folder.update_metrics): entropy,
    KL, clipping, the method's weights, and the trainer's log-prob l against the sampler's s."""
    active = torch.ones_like(logp) if terms.active is None else terms.active
    kl = torch.zeros_like(logp) if ref_logp is None else k3(logp, ref_logp)
    clipped = ppo_clipped(torch.exp(logp - old_logp), adv, cfg) & METHODS[cfg.method].clip
    w, log_r = terms.pg_weight.detach(), old_logp - sampler_logp
    per_token = dict(entropy=entropy, kl=kl, clipped=clipped, w=w, touched=touched_tokens(terms))
    per_token |= dict(pg_on=(w != 0) & (active != 0), sampler_diff=log_r.abs(), r=log_r.exp())
    return {name: values[mask.bool()].float() for name, values in per_token.items()}


def touched_tokens(terms: TokenTerms) -> torch.Tensor:
    """Tokens whose loss the method changed: weighted other than 1, outside the pass, penalised."""
    touched = terms.pg_weight.detach() != 1
    if terms.active is not None:
        touched |= terms.active == 0
    if terms.extra is not None:
        touched |= terms.extra.detach() != 0
    return touched


# 9. The training loop ---------------------------------------------------------------------------
def collect_rollout(model, reference, tokenizer, prompts, grader, cfg: Config, engine=None):
    """Sample a batch, score it, compute its advantages (grading runs during the passes)."""
    method = METHODS[cfg.method]
    rollout = sample(model, tokenizer, prompts.next_batch(cfg.prompts_per_step), cfg, engine)
    calls = [(text, gold, "default") for text, gold in zip(rollout.texts, rollout.golds)]
    grades = grader.submit(calls)  # a future: the workers grade while the passes below run
    if cfg.num_iterations > 1 or method.needs_stats:
        stats = policy_token_stats(model, rollout, cfg, method.needs_divergence)
        rollout.old_logp, rollout.entropy = stats["logp"], stats["entropy"]
        rollout.divergence = stats.get("divergence")
        rollout.batch_entropy = rollout.entropy[rollout.completion_mask.bool()].sort().values
    if cfg.beta > 0:  # the KL reference: a frozen copy, or under LoRA the base (adapter off)
        with lora.reference_of(model, reference) as frozen:
            rollout.ref_logp = policy_token_stats(frozen, rollout, cfg)["logp"]
    return rollout, rollout_rewards(rollout, grades.result(), cfg)


def accumulate_gradients(model, rollout: Rollout, cfg: Config, autocast, update_pass: int = 0):
    """The step's loss gradient into .grad, micro-batch by micro-batch; the loss, the metrics."""
    model.train()
    n_responses = len(rollout.texts)
    n_tokens = int(rollout.completion_mask.sum().clamp(min=1))
    total_loss, metrics = 0.0, []
    for _, part in rollout.micro_batches(cfg):
        with autocast():
            totals = (n_responses, n_tokens, update_pass)
            loss, (logp, old_logp, entropy, terms) = micro_batch_loss(model, part, cfg, *totals)
        loss.backward()
        total_loss += loss.item()
        tokens = (part.ref_logp, entropy, part.advantages, part.completion_mask, part.sampler_logp)
        metrics.append(token_metrics(logp, old_logp, *tokens, terms, cfg))
    return total_loss, metrics


def update(model, optimizer, scheduler, rollout, cfg, autocast, update_pass: int = 0) -> dict:
    """One optimizer step over the rollout batch; returns its metrics."""
    loss, metrics = accumulate_gradients(model, rollout, cfg, autocast, update_pass)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return update_metrics(metrics, loss, grad_norm.item(), lr)


def training_loop(cfg, model, reference, tokenizer, prompts, grader, engine, run, on_rollout):
    """Sample, score, advantages, update, log, save: the paper's algorithm, step after step."""
    method, device = METHODS[cfg.method], next(model.parameters()).device
    updates = cfg.num_iterations * method.update_passes  # per rollout batch
    # AdamW (fused on CUDA: one kernel, no foreach temporaries), cosine schedule after a warmup
    adamw = dict(weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    trained = [p for p in model.parameters() if p.requires_grad]  # all, or LoRA's adapter
    optimizer = torch.optim.AdamW(trained, cfg.learning_rate, **adamw)
    cosine, total = transformers.get_cosine_with_min_lr_schedule_with_warmup, cfg.steps * updates
    warmup = int(cfg.warmup_ratio * total)
    scheduler = cosine(optimizer, warmup, total, min_lr_rate=cfg.min_lr_ratio)
    start_step, views = 0, []
    if run.resume_from is not None:  # its optimizer, schedule, RNG, data position and first view
        state = checkpoints.restore(run.resume_from, optimizer, scheduler)
        start_step, prompts.position = state["step"], state["data_position"]
        views = state.get("token_views", [])[:1]
    else:
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    autocast = loading.autocast(device)  # bf16 compute on CUDA over fp32 master weights
    progress = Progress(start_step, cfg.steps, cfg.method, cfg.log_every)
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        with autocast():
            policy = (model, reference, tokenizer)
            rollout, scores = collect_rollout(*policy, prompts, grader, cfg, engine)
            if step == 0 or step + 1 == cfg.steps:  # tokens.html shows the first and last steps
                with never_fatal("draw the token page"):
                    views.append(token_view(model, tokenizer, rollout, cfg, f"step {step + 1}"))
        rollout_s = time.perf_counter() - t0
        if on_rollout is not None:
            on_rollout(step + 1, model, rollout, autocast)
        for update_index in range(updates):
            t1, update_pass = time.perf_counter(), update_index % method.update_passes
            record = {"step": step * updates + update_index + 1, "rollout_step": step + 1}
            record |= {"update_pass": update_pass, **scores}
            record |= update(model, optimizer, scheduler, rollout, cfg, autocast, update_pass)
            record |= {"prompts_skipped": prompts.skipped, "rollout_s": rollout_s}
            record |= {"update_s": time.perf_counter() - t1, "time": time.time()}
            seconds = rollout_s + record["update_s"]
            record["tokens_per_s"] = rollout.completion_mask.sum().item() / seconds
            run.log(record)
        progress.step(**{k: f"{record[k + '_mean']:.3f}" for k in ("reward", "entropy")})
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps or run.stop.requested:
            more = dict(token_views=views, data_position=prompts.position)
            run.save(step + 1, model, tokenizer, optimizer, scheduler, cfg.save_total_limit, more)
            draw(run.path, cfg, views)
        run.stop_if_requested(step + 1)  # after a Ctrl-C or SIGTERM: with the checkpoint just saved
    progress.close()
    checkpoints.save_checkpoint(run.path, "final-model", lora.merged_model(model), tokenizer)


# Options a resumed run may change, none of them its recipe: more --steps extend it (the cosine
# schedule is then recomputed over the new total), the rest say where and how often it reports.
RESUME_MAY_CHANGE = ("steps", "save_every", "log_every", "reward_workers", "output_dir")
RESUME_MAY_CHANGE += ("report_to",)


def train(cfg: Config, on_rollout: Callable | None = None) -> Path:
    """Everything a run needs, then the training loop. on_rollout(step, model, rollout, autocast),
    if given, sees each scored rollout batch before the update (tools/diagnose.py uses it)."""
    start = time.perf_counter()
    device = loading.resolve_device(cfg.device, "" if cfg.preset in BASES else cfg.preset)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    print(plots.run_header(cfg), flush=True)
    plots.pyplot()  # fail now, not at the first checkpoint, if matplotlib is missing
    options, plan_options = dataclasses.asdict(cfg), memory_plan.PlanOptions.of(cfg)
    starting = (cfg.resume, cfg.overwrite_output_dir, RESUME_MAY_CHANGE, cfg.report_to)
    # locked against a second run, Ctrl-C a stop after the step, a resume's checkpoint checked
    with RunFolder(cfg.output_dir, options, *starting) as run:
        cfg = dataclasses.replace(cfg, model=presets.ready(cfg.model, cfg.dataset))  # CPU presets
        if device.type == "cuda":  # before anything loads: a run that cannot fit stops here
            memory_plan.check_fit(cfg.model, plan_options, *torch.cuda.mem_get_info())
        loading.check_model_path(cfg.model)
        if run.finished(cfg.steps):
            return run.path
        columns = (cfg.question_column, cfg.gold_column)
        dataset = loading.load_dataset(cfg.dataset, cfg.dataset_split, *columns)
        with Grader(cfg.reward_timeout_s, cfg.reward_workers) as grader:
            used = dict(torch_threads=torch.get_num_threads(), reward_workers_used=grader.size)
            run.start(options | used)
            weights = str(run.resume_from or cfg.model)
            print(f"loading {cli.shown_path(weights)} ...", flush=True)
            tokenizer = loading.load_tokenizer(weights)
            prompts = PromptStream(dataset, tokenizer, cfg)
            lora_options = (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules, cfg.seed)
            policy = (cfg.model, run.resume_from, device, *lora_options)
            model = loading.load_policy(*policy, checkpointing=cfg.gradient_checkpointing)
            frozen_copy = cfg.beta > 0 and not cfg.lora_rank  # LoRA's reference: the base itself
            reference = loading.load_reference(cfg.model, device) if frozen_copy else None
            vllm = (plan_options, device, cfg.vllm_gpu_memory_utilization, cfg.seed)
            engine = Engine.for_run(cfg.model, *vllm) if cfg.rollout == "vllm" else None
            loop = (model, reference, tokenizer, prompts, grader, engine, run, on_rollout)
            training_loop(cfg, *loop)
    final_model = ("--model", str(run.path / "final-model"), *presets.evaluate_options(cfg.preset))
    evaluate = cli.command(str(REPOSITORY / "evaluate.py"), *final_model)
    print(plots.run_summary(run.path, time.perf_counter() - start, evaluate))
    return run.path


# What a run shows beside metrics.jsonl: tokens.html and curves.png ------------------------------
PASSES = token_page.passes({name: (m.description, m.update_passes) for name, m in METHODS.items()})
CW_NOTE = "cw as released normalises its weights over padded positions, so their mean over real "
CW_NOTE += "tokens is above 1 and most tokens show orange."
ABOUT = {shown: text for shown, *_, text in PASSES}  # what the page's selector says of each


@torch.no_grad()
def token_view(model, tokenizer, rollout: Rollout, cfg: Config, label: str, shown: int = 4):
    """What tokens.html shows of the batch's first group: a few completions, token by token, with
    each token's probability, covariance score (cw step 3), and the weight every method's update
    pass gives it. The RNG is restored (clip_cov draws), so training goes on unchanged."""
    rows = rollout.select(0, cfg.group_size)
    with checkpoints.rng_kept():
        stats, mask = policy_token_stats(model, rows, cfg, divergence=True), rows.completion_mask
        logp, entropy, divergence = stats["logp"], stats["entropy"], stats["divergence"]
        batch_entropy = entropy[mask.bool()].sort().values
        group = Group(logp, logp, rows.advantages, mask, entropy, batch_entropy, divergence, 0)
        terms = {
            shown_as: METHODS[name].token_terms(group._replace(update_pass=update_pass), cfg)
            for shown_as, name, update_pass, _ in PASSES
        }
    weights = {k: t.pg_weight * (1 if t.active is None else t.active) for k, t in terms.items()}
    cov = covariance_score(logp, rows.advantages, mask)
    touched = {k: touched_tokens(t) for k, t in terms.items()}
    prompt = tokenizer.decode(rows.prompt_ids[0, rows.prompt_mask[0].bool()])
    scored = (prompt, (rows.rewards, rows.accuracy), rows.completion_ids[:shown], mask)
    return token_page.view(label, tokenizer, *scored, logp, cov, rows.advantages, weights, touched)


def draw(output_dir: Path, cfg: Config, views: list[dict]) -> None:
    """The run's curves (curves.png) and its tokens (tokens.html), redrawn from what it holds."""
    title, note = f"{cfg.method} on {cfg.model}, seed {cfg.seed}", CW_NOTE
    note *= cfg.cw_norm == "padded"
    plots.draw_run(output_dir, title, cfg.method, ABOUT, views, note)


def main(cfg: Config, on_rollout: Callable | None = None) -> None:
    if cfg.plan:
        tiny.build_if_missing(cfg.model)
        return print(memory_plan.report(cfg.model, memory_plan.PlanOptions.of(cfg)))
    train(cfg, on_rollout)


if __name__ == "__main__":
    main(CONFIG)
