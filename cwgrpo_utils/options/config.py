"""The algorithm's options: Config (what a run computes; --help's first group), the tables its
choices come from, the registry of --method's choices (METHODS, each filled where cwgrpo.py's
section 5 defines it), how section 1 samples (Sampling) and section 3 computes (Passes), and
parse_config, which reads a command line into Config and the run's RunConfig. Light on purpose:
read before torch is imported, so --help and a bad option answer at once. cwgrpo.py imports them;
the formulas they parametrise are docs/math.md's."""

import sys
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple

from cwgrpo_utils import OPEN_RS_SYSTEM_PROMPT
from cwgrpo_utils.options import cli
from cwgrpo_utils.options.cli import arg
from cwgrpo_utils.options.presets import PRESETS
from cwgrpo_utils.options.run_config import RunConfig, micro_batch_rows

DESCRIPTION = (
    'cwgrpo.py: CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel '
    'Advantage Reweighting", Wang et al., ACL 2026) and the token-weighting methods it is compared '
    "with; docs/math.md has every formula."
)

# --method's choices, in the order section 5 defines them, and the Config fields each reads
METHOD_OPTIONS = {
    "grpo": (),
    "cw": ("cw_reading", "cw_norm", "cw_detach", "cw_gradient_only"),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "kl_cov_coef"),
    "ar": ("ar_alpha",),
    "lopti": ("lopti_eta",),
    "ar_lopti": ("ar_lopti_alpha", "ar_lopti_eta"),
    "ict": ("ict_keep_frac",),
    "entropy20": ("entropy_top_frac",),
    "stapo": ("stapo_max_prob", "stapo_entropy_percentile"),
}
# What each --cw-reading means (docs/fidelity.md). gradient-only is a control: weights of value
# exactly 1 that carry the released weights' gradient
CW_READINGS = {
    "released": dict(cw_norm="padded", cw_detach=False, cw_gradient_only=False),
    "paper": dict(cw_norm="valid", cw_detach=True, cw_gradient_only=False),
    "gradient-only": dict(cw_norm="padded", cw_detach=False, cw_gradient_only=True),
}
CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean")


@dataclass
class Method:
    """A --method: its token terms (cwgrpo.py, section 5), and what the training loop does."""

    token_terms: Callable  # (Group, Config) -> TokenTerms
    description: str
    clip: bool = True  # PPO's clipped surrogate (kl_cov: off)
    update_passes: int = 1  # lopti: a pass on the low-probability tokens, then one on the rest
    needs_stats: bool = False  # the batch's old log-probs and entropies, before the update
    needs_divergence: bool = False  # and ict's divergence, in the same pass

    @property
    def options(self) -> tuple[str, ...]:
        """The Config fields it reads."""
        return METHOD_OPTIONS[self.token_terms.__name__]


METHODS: dict[str, Method] = {}  # --method's choices, each registered where cwgrpo.py defines it


def register_method(description: str, **needs) -> Callable:
    """Registers the token-terms function it decorates under its name, with what it needs of the
    loop (Method's fields), as verl's register_policy_loss does."""

    def register(token_terms: Callable) -> Callable:
        METHODS[token_terms.__name__] = Method(token_terms, description, **needs)
        return token_terms

    return register


@dataclass
class Config:
    """The algorithm's options. The defaults are the released 1.5B recipe (docs/math.md, "Recipe");
    PRESETS (cwgrpo_utils/options/presets.py) override some. --help shows the defaults of the
    --preset given (paper-1.5b when none is)."""

    _argument_group_name = "the algorithm (what a run computes)"

    preset: Literal[tuple(PRESETS)] = arg("paper-1.5b", "a recipe whose values are the defaults")
    method: Literal[tuple(METHOD_OPTIONS)] = arg("cw", "token-weighting method (section 5)")
    # Model and data
    model: str = arg("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "hub id or local folder")
    dataset: str = arg("knoveleng/open-rs", "hub id or local .json/.jsonl/.parquet/.csv file")
    dataset_split: str = arg("train", "split of a hub dataset")
    question_column: str = arg("problem", "column of the question")
    gold_column: str = arg("solution", "column of the reference solution (parsed by math-verify)")
    system_prompt: str = arg(OPEN_RS_SYSTEM_PROMPT, "system message (Open-RS's); empty: none")
    max_prompt_length: int = arg(512, "longer prompts are skipped (and counted)", "> 0")
    # Sampling (section 1)
    group_size: int = arg(12, "G, completions sampled per prompt", ">= 2")
    prompts_per_step: int = arg(12, "prompts per rollout batch", "> 0")
    max_completion_length: int = arg(4096, "generation limit; see --length-limit", "> 0")
    length_limit: Literal["total", "new"] = arg("total", "of prompt + completion, or new tokens")
    temperature: float = arg(0.7, "sampling temperature; log-probs use it too", "> 0")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 is off (paper)", "in (0, 1]")
    top_k: int = arg(0, "top-k sampling; 0 is off (paper)", ">= 0")
    # Reward (section 2)
    accuracy_weight: float = arg(1.0, "weight of the accuracy reward", ">= 0")
    format_weight: float = arg(1.0, "weight of the format reward", ">= 0")
    reward_timeout_s: float = arg(10.0, "hard limit on grading one completion", "> 0")
    # The loss (section 6)
    beta: float = arg(0.04, "k3 KL coefficient; 0 loads no reference model", ">= 0")
    eps_low: float = arg(0.2, "PPO clip range below 1", ">= 0")
    eps_high: float = arg(0.2, "PPO clip range above 1", ">= 0")
    loss_aggregation: Literal[AGGREGATIONS] = arg(AGGREGATIONS[0], "GRPO's (paper), or DAPO's")
    num_iterations: int = arg(1, "policy updates per rollout batch (paper: 1)", "> 0")
    mask_truncated_completions: bool = arg(False, "drop completions cut at the limit from the loss")
    sampler_correction: Literal[CORRECTIONS] = arg("none", "for the sampler-trainer mismatch")
    sampler_correction_cap: float = arg(
        3.0, "r_max: truncate the ratio r at it, or mask above it", "> 0"
    )
    sampler_correction_min: float = arg(0.0, "r_min: *_mask also masks ratios below it", ">= 0")
    # Each method's options (section 5; METHOD_OPTIONS)
    cw_reading: Literal[tuple(CW_READINGS)] = arg("released", "cw: a reading (CW_READINGS)")
    cw_norm: Literal["padded", "valid"] = arg("padded", "cw: mean 1 over padded or real tokens")
    cw_detach: bool = arg(False, "cw: no gradient through the weights (released code: it flows)")
    cw_gradient_only: bool = arg(False, "cw: weights of value 1 with the weights' gradient")
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
    # The optimizer and its schedule (section 7)
    learning_rate: float = arg(1e-6, "peak AdamW learning rate", "> 0")
    min_lr_ratio: float = arg(0.1, "the cosine schedule ends at this x peak", "in [0, 1]")
    warmup_ratio: float = arg(0.1, "share of steps with linear warmup", "in [0, 1]")
    weight_decay: float = arg(0.0, "AdamW weight decay", ">= 0")
    max_grad_norm: float = arg(1.0, "gradient clipping norm", "> 0")
    steps: int = arg(300, "rollout batches to train on", "> 0")
    seed: int = arg(2025, "seed of data order and sampling", ">= 0")

    def __post_init__(self):
        """Every value is checked here, at parse time, before any slow work."""
        cli.check_ranges(self)
        lb, ub = self.clip_cov_lb, self.clip_cov_ub
        cli.check(lb < ub, f"--clip-cov-lb ({lb}) must be below --clip-cov-ub ({ub})")
        cli.check(
            self.length_limit == "new" or self.max_prompt_length < self.max_completion_length,
            f"--max-prompt-length ({self.max_prompt_length}) leaves no room for a completion "
            f"within --max-completion-length ({self.max_completion_length}) under --length-limit "
            "total",
        )
        if self.cw_reading != "released":  # the one place a reading is resolved
            for name, value in CW_READINGS[self.cw_reading].items():
                setattr(self, name, value)


def parse_config(argv=None, *extra, hidden: tuple = (), prog: str | None = None) -> list:
    """[the algorithm's Config, the run's RunConfig, and one of each dataclass a tool adds] from
    the command line, the --preset's values as defaults: an option that only another --method
    reads noted, a --cw-reading contradicted by the options it sets refused, and the default
    --output-dir named for the method, preset and seed. `hidden` options stay out of --help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parsed, given = cli.parse_dataclasses(
        [Config, RunConfig, *extra],
        argv,
        presets=PRESETS,
        hidden=hidden,
        description=DESCRIPTION,
        prog=prog,
    )
    cfg, run_cfg = parsed[:2]
    cli.check_implied(given, "cw_reading", CW_READINGS)  # a reading names three choices
    cli.note_unused(given, "method", cfg.method, options_of=METHOD_OPTIONS)
    prompts, per_micro_batch = cfg.prompts_per_step, run_cfg.groups_per_micro_batch
    cli.check(
        prompts % (per_micro_batch or prompts) == 0,
        f"--prompts-per-step ({prompts}) must be a multiple of --groups-per-micro-batch "
        f"({per_micro_batch})",
    )
    run_cfg.output_dir = run_cfg.output_dir or f"runs/{cfg.method}-{cfg.preset}-seed{cfg.seed}"
    if cfg.method == "kl_cov" and cfg.num_iterations == 1:
        note = "note: kl_cov's |logp - old_logp| is 0 with one update per batch: it trains as GRPO"
        cli.warn_once(note, note + "; use --num-iterations 2")
    return parsed


class Passes(NamedTuple):
    """How a step's passes compute (the run's options), not what: the same values to rounding
    (tests/test_shared_prompts.py)."""

    micro_batch_rows: int  # rows a log-prob forward (and backward) holds: whole groups
    rollout_chunk: int  # prompts sampled at once, which bounds the KV cache; 0: all
    share_prompts: bool  # each group's prompt encoded once, in sampling and in the log-probs
    logit_chunk_elements: int  # logits the LM head holds at once; 0: every position's

    @classmethod
    def of(cls, cfg: Config, run_cfg: RunConfig) -> "Passes":
        per_group = run_cfg.groups_per_micro_batch
        return cls(
            micro_batch_rows=micro_batch_rows(per_group, cfg.prompts_per_step, cfg.group_size),
            rollout_chunk=run_cfg.rollout_chunk,
            share_prompts=run_cfg.share_prompts,
            logit_chunk_elements=run_cfg.logit_chunk_elements,
        )


class Sampling(NamedTuple):
    """How section 1 draws completions: n a prompt from softmax(logits / temperature), cut to top_k
    and the top_p nucleus (0 and 1: off), each at most max_new_tokens long or, with max_total, at
    most max_total tokens with its prompt (as vLLM's max model length)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    max_total: int | None = None

    @classmethod
    def of(cls, cfg: Config) -> "Sampling":
        """A run's: G completions a prompt, within --max-completion-length of new tokens or, under
        --length-limit total, of prompt and completion."""
        limit = cfg.max_completion_length
        return cls(
            n=cfg.group_size,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=limit,
            max_total=limit if cfg.length_limit == "total" else None,
        )
