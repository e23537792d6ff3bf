"""The GPU memory and disk a run will need, from the model's config.json and the run's options
alone, before anything loads. cwgrpo.py prints it (--plan) and checks it against the GPU before a
CUDA run; PlanOptions declares the options it reads.

Every item is counted, not guessed (the tests compare each with real allocations on the CPU):
- weights, gradients and AdamW's two moments: fp32, 4 + 4 + 8 bytes a parameter;
- the KL reference: bf16 on CUDA (fp32 on the CPU), none when beta is 0;
- autocast's bf16 copies of the weights a matrix multiply reads, held for the step (CUDA);
- the KV cache: rows sampled at once x (prompt + completion) positions x layers x 2 x KV width;
- activations saved for backward, per token and layer 8 H + 4 I + 2 KV + heads + 2 values (the
  layer's norms, projections, rotary embedding, attention with its log-sum-exp, and MLP), or with
  gradient checkpointing only each layer's input, plus one layer's worth recomputed in backward;
- the LM head's chunks of logits (lm_head.py) and, without a fused AdamW, its foreach temporaries;
- with --rollout vllm, no KV cache of ours: the engine holds, while it samples, its bf16 weights,
  its CUDA graphs (CUDA_GRAPHS) and a KV cache pinned in bytes (engine_memory: every row of the
  step at its longest, or what --vllm-gpu-memory-utilization of the card leaves, but at least one
  group);
  in the update it sleeps, holding none (its graphs offloaded to the CPU), and sets no cap on the
  memory the trainer beside it may take;
- with LoRA and --rollout vllm, one adapted layer's merge at a time while the weights are pushed.

bf16 and fp16 hold the same bytes, so the figures are those of either; --precision fp32 on a GPU
holds its reference and KV cache in fp32 and casts no weight. A run that runs out of memory all
the same (a late, long batch) stops in one line naming the phase and what lowers it (OutOfMemory).
"""

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download

from cwgrpo_utils import REPOSITORY
from cwgrpo_utils.machine.precision import capability_choice
from cwgrpo_utils.options.config import Config
from cwgrpo_utils.options.run_config import RunConfig, micro_batch_rows
from cwgrpo_utils.run import checkpoints

SHIPPED_CONFIGS = REPOSITORY / "cwgrpo_utils" / "models" / "model_configs"  # each preset's config
# Common cards: name, memory in GB (as sold) and compute capability, from which auto's precision
# follows (bf16 from 8.0, fp16 on 7.x)
CARDS = (
    ("RTX 3060", 12, (8, 6)),
    ("T4", 16, (7, 5)),
    ("V100 16 GB", 16, (7, 0)),
    ("RTX 4060 Ti 16 GB", 16, (8, 9)),
    ("A4000", 16, (8, 6)),
    ("L4", 24, (8, 9)),
    ("A10", 24, (8, 6)),
    ("RTX 3090", 24, (8, 6)),
    ("RTX 4090", 24, (8, 9)),
    ("A100 40 GB", 40, (8, 0)),
    ("L40S", 48, (8, 9)),
    ("A6000", 48, (8, 6)),
    ("A100 80 GB", 80, (8, 0)),
    ("H100", 80, (9, 0)),
    ("H200", 141, (9, 0)),
)
GPU_SIZES_GB = tuple(sorted({size for _, size, _ in CARDS}))
USABLE = 0.92  # of a card's memory, after the CUDA context and the allocator's fragmentation
GB = 1e9
# What the vLLM engine's captured CUDA graphs hold while it samples, counted at the most (they take
# 0.2-1 GB at these sizes); asleep, the engine offloads them to the CPU (vllm_engine.py)
CUDA_GRAPHS = 1 * GB


@dataclass
class Architecture:
    """The numbers of a decoder-only (Qwen2- or Llama-style) transformer that the plan reads."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = True  # Qwen2's q/k/v projections have biases; Llama's only with attention_bias
    o_bias: bool = False  # Llama's attention_bias covers o_proj too
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: dict) -> "Architecture":
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        llama_bias = config.get("attention_bias", False)
        qwen2 = config.get("model_type", "qwen2") == "qwen2"  # a config that names none: Qwen2's
        return cls(
            config["vocab_size"],
            config["hidden_size"],
            config["intermediate_size"],
            config["num_hidden_layers"],
            heads,
            config.get("num_key_value_heads", heads),
            head_dim,
            bool(config.get("tie_word_embeddings", False)),
            qwen2 or llama_bias,
            not qwen2 and llama_bias,
            config.get("mlp_bias", False),
        )

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def parameters(self) -> int:
        """Exact: embeddings, per layer q/k/v and o, the gated MLP and two norms, each linear
        layer's bias where the config has one, the final norm, and the LM head unless tied."""
        shapes = self.projections().items()
        weights = sum(n_in * n_out for _, (n_in, n_out) in shapes)
        biased = dict(q_proj=self.qkv_bias, k_proj=self.qkv_bias, v_proj=self.qkv_bias)
        biased["o_proj"] = self.o_bias
        biases = sum(n_out for name, (_, n_out) in shapes if biased.get(name, self.mlp_bias))
        layer, h = weights + biases + 2 * self.hidden, self.hidden
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear layers, name -> (inputs, outputs)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_width, self.intermediate
        attention = dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h))
        return attention | dict(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))

    def adapted(self, target_modules: str) -> list[tuple[int, int]]:
        """The (inputs, outputs) of every linear layer a LoRA adapter on target_modules covers
        ("all-linear": all of them but the LM head, as PEFT reads it)."""
        names = target_modules.split(",") if target_modules != "all-linear" else None
        shapes = [
            shape for name, shape in self.projections().items() if names is None or name in names
        ]
        return shapes * self.layers

    def lora_parameters(self, rank: int, target_modules: str) -> int:
        """Exact: A (r x inputs) and B (outputs x r) on each adapted layer."""
        return sum(rank * (n_in + n_out) for n_in, n_out in self.adapted(target_modules))


def read_config(model: str) -> dict:
    """config.json of a local folder, of a preset's model (shipped in model_configs/, so the plan
    works offline), or from the hub (or its cache)."""
    local = Path(model) / "config.json"
    shipped = SHIPPED_CONFIGS / f"{model.replace('/', '--')}.json"
    for path in (local, shipped):
        if path.is_file():
            return json.loads(path.read_text())
    try:
        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception as error:  # noqa: BLE001 - any failure to find it is the same one line
        raise SystemExit(
            f"error: no config.json for {model} (local, shipped or hub): "
            f"{type(error).__name__}; pass a local model folder"
        ) from None


@dataclass
class PlanOptions:
    """The options of a run the plan reads, by the names Config and RunConfig give them."""

    group_size: int
    prompts_per_step: int
    groups_per_micro_batch: int  # 0: all of a step's groups at once
    rollout_chunk: int  # prompts sampled at once; 0: all of them
    max_prompt_length: int
    max_completion_length: int
    length_limit: str  # "total": prompt + completion within max_completion_length; "new"
    beta: float  # 0: no reference model
    gradient_checkpointing: bool
    share_prompts: bool  # a group's prompt encoded once (shared_prompt.py)
    logit_chunk_elements: int  # 0: every position's logits at once
    lora_rank: int  # 0: full fine-tuning; else a frozen base under an adapter of this rank
    lora_target_modules: str
    rollout: str  # "vllm": an engine holds vllm_gpu_memory_utilization of the card as it samples
    vllm_gpu_memory_utilization: float
    steps: int
    save_every: int
    save_total_limit: int  # 0: every checkpoint is kept
    precision: str = "auto"  # fp32: no half-precision copy of anything (bf16 and fp16: alike)

    @classmethod
    def of(cls, cfg: Config, run_cfg: RunConfig) -> "PlanOptions":
        """A run's: cfg its algorithm's options, run_cfg its run's."""
        return cls(
            group_size=cfg.group_size,
            prompts_per_step=cfg.prompts_per_step,
            groups_per_micro_batch=run_cfg.groups_per_micro_batch,
            rollout_chunk=run_cfg.rollout_chunk,
            max_prompt_length=cfg.max_prompt_length,
            max_completion_length=cfg.max_completion_length,
            length_limit=cfg.length_limit,
            beta=cfg.beta,
            gradient_checkpointing=run_cfg.gradient_checkpointing,
            share_prompts=run_cfg.share_prompts,
            logit_chunk_elements=run_cfg.logit_chunk_elements,
            lora_rank=run_cfg.lora_rank,
            lora_target_modules=run_cfg.lora_target_modules,
            rollout=run_cfg.rollout,
            vllm_gpu_memory_utilization=run_cfg.vllm_gpu_memory_utilization,
            steps=cfg.steps,
            save_every=run_cfg.save_every,
            save_total_limit=run_cfg.save_total_limit,
            precision=run_cfg.precision,
        )

    @property
    def n_rows(self) -> int:  # completions a step
        return self.prompts_per_step * self.group_size

    @property
    def sampled_rows(self) -> int:  # rows sampled at once (the KV cache holds them)
        return (
            min(self.rollout_chunk or self.prompts_per_step, self.prompts_per_step)
            * self.group_size
        )

    @property
    def micro_rows(self) -> int:  # rows in one forward and backward pass
        return micro_batch_rows(self.groups_per_micro_batch, self.prompts_per_step, self.group_size)

    @property
    def positions(self) -> int:  # prompt + completion positions a row holds at most
        new_only = self.length_limit == "new"
        return self.max_completion_length + self.max_prompt_length * new_only

    @property
    def engine_share(self) -> float:
        return self.vllm_gpu_memory_utilization if self.rollout == "vllm" else 0.0


def plan(model: str, options: PlanOptions, cuda: bool = True) -> dict:
    """Bytes of each item, the peak of each phase, and the disk, for `model` trained in `options`.
    cuda: bf16 (or fp16) autocast and a half-precision reference, unless --precision fp32; else
    all fp32."""
    arch = Architecture.from_config(read_config(model))
    n, rank, targets = arch.parameters(), options.lora_rank, options.lora_target_modules
    trained = arch.lora_parameters(rank, targets) if rank else n  # LoRA trains its adapter only
    micro_rows, positions = options.micro_rows, options.positions
    cuda = cuda and options.precision != "fp32"  # an fp32 run on a GPU holds what a CPU run does
    half = 2 if cuda else 4  # bf16 or fp16 on CUDA (autocast, reference, KV cache), else fp32
    matmul_weights = n - (0 if arch.tied else arch.vocab * arch.hidden)  # embeddings are looked up
    tokens = micro_rows * positions
    saved, recompute = activations(arch, options, cuda)
    if rank:  # a frozen base (bf16 on CUDA), which with the adapter off is also the reference
        weights = {"frozen base weights": half * n, "LoRA adapter (fp32)": 4 * trained}
    else:
        weights = {"weights (fp32)": 4 * n}
    items = weights | {
        "gradients (fp32)": 4 * trained,
        "AdamW moments (fp32)": 8 * trained,
        "reference": half * n if options.beta > 0 and not rank else 0,
        # the bf16 base needs none: only fp32 weights are cast for a matrix multiply
        "autocast weight copies (bf16)": 2 * (trained if rank else matmul_weights) * cuda,
        "KV cache": options.sampled_rows * positions * arch.layers * 2 * arch.kv_width * half,
        "activations saved for backward": saved,
        "one layer recomputed in backward": recompute,
        "LM head chunks": 3
        * 4
        * min(options.logit_chunk_elements or math.inf, tokens * arch.vocab),
    }
    engine_share = options.engine_share
    if engine_share:  # the engine's own, counted per card (engine_memory)
        items["KV cache"] = 0
        if rank:  # a push merges one adapted layer at a time: the fp32 delta and sum, the cast
            items["LoRA push (one layer merged)"] = max(
                n_in * n_out * (4 + 4 + half) for n_in, n_out in arch.adapted(targets)
            )
    resident = sum(weights.values()) + items["AdamW moments (fp32)"] + items["reference"]
    phases = {
        "rollout": resident
        + items["autocast weight copies (bf16)"] * (not engine_share)
        + items["KV cache"]
        + options.sampled_rows * arch.vocab * 4 * 3 * (not engine_share)  # logits, probs, CDF
        + items.get("LoRA push (one layer merged)", 0),
        "update": resident
        + items["gradients (fp32)"]
        + items["autocast weight copies (bf16)"]
        + saved
        + 2 * recompute
        + items["LM head chunks"],  # a layer's backward: as much again
        "optimizer step": resident + items["gradients (fp32)"],  # fused AdamW: no temporaries
    }
    return {
        "parameters": n,
        "items": items,
        "phases": phases,
        "peak": max(phases.values()),
        "resident": resident,  # what every phase holds: weights, AdamW's moments, the reference
        "engine_share": engine_share,
        # the engine's weights in its dtype, and its KV cache of one row at its longest
        "engine_weights": half * n if engine_share else 0,
        "engine_row_kv": positions * arch.layers * 2 * arch.kv_width * half,
        "disk": disk(n, trained, options, half),
        "n_rows": options.n_rows,
        "group_size": options.group_size,
        "positions": positions,
    }


def activations(arch: Architecture, options: PlanOptions, cuda: bool) -> tuple[int, int]:
    """The bytes a micro-batch's update saves for backward, and what its backward recomputes at
    once under gradient checkpointing (a layer, or shared the whole prompt pass if more).

    Unshared, the decoder over rows x (prompt + completion) tokens. Shared (--share-prompts): the
    prompts' pass over a row a group, then the completions' against their keys and values. Left
    padding (prompts of different lengths) gives each attention a mask and transformers' SDPA
    then repeats the KV heads to every query head (masked_layer). Checkpointed, the prompt pass
    keeps only its keys and values. Measured on the CPU (tests/test_plan.py) at five shapes.
    LoRA: the frozen norms keep no normalised input for their weights' gradient (2 H fp32), and
    each adapter's B keeps its r-wide A x (measured with every linear layer adapted; with fewer,
    the frozen layers keep less, so this is an upper bound)."""
    n_rows, rank, hidden = options.micro_rows, options.lora_rank, arch.hidden
    adapters_per_layer = len(arch.adapted(options.lora_target_modules)) // arch.layers
    lora_change = (2 if cuda else 4) * rank * adapters_per_layer - 2 * hidden * 4 if rank else 0
    head = n_rows * options.max_completion_length * hidden * 4  # the LM head's input (lm_head.py)
    completion, positions = options.max_completion_length, options.positions
    if options.share_prompts:  # completions of up to max_completion_length, within positions
        prompts, prompt = n_rows // options.group_size, options.max_prompt_length
        layer = masked_layer(arch, cuda, n_rows, completion, positions, lora_change)
        prompt_layer = masked_layer(arch, cuda, prompts, prompt, prompt, lora_change)
        completions, prompt_tokens = n_rows * completion, prompts * prompt
    else:
        layer = masked_layer(arch, cuda, n_rows, positions, positions, lora_change)
        completions, prompt_tokens, prompt_layer = n_rows * positions, 0, 0
    if options.gradient_checkpointing:  # each layer's input, the final norm's
        checkpointed = completions * hidden * 4 * (arch.layers + 2 - (rank > 0))
        recomputed = max(layer, prompt_layer * arch.layers)  # the prompt pass is one checkpoint
        return checkpointed + n_rows * options.positions * 12 + head, recomputed
    tokens = completions + prompt_tokens
    final_norm = 0 if rank else 2 * tokens * hidden * 4  # frozen: only its input, kept anyway
    rotary = tokens * 4 * (arch.head_dim // 2 + 3)
    return (layer + prompt_layer) * arch.layers + final_norm + rotary + head, 0


def masked_layer(
    arch: Architecture, cuda: bool, n_rows: int, queries: int, keys: int, lora_change: int
) -> int:
    """Bytes one decoder layer saves for n_rows rows of `queries` tokens, each attending under a
    mask to its row's `keys` positions: layer_activation_bytes's a query token, the keys and values
    repeated to every query head, and the mask, one element a query and key."""
    element = 2 if cuda else 4  # what autocast computes in
    per_query = layer_activation_bytes(arch, cuda) + lora_change - 2 * arch.kv_width * element
    repeated = keys * 2 * arch.heads * arch.head_dim * element
    return n_rows * (queries * per_query + repeated + queries * keys * element)


def layer_activation_bytes(arch: Architecture, cuda: bool) -> int:
    """Bytes one decoder layer saves for backward per token. On the CPU (fp32): 8 H + 4 I + 2 KV +
    heads + 2 values, the unique storages that saved_tensors_hooks sees (found at four shapes and
    tested at another): the two RMSNorms' fp32 tensors (6 H + 2), the attention's inputs and output,
    the gated MLP's four I-wide tensors and one log-sum-exp per head. On CUDA, under bf16 autocast,
    the norms stay fp32, the rest is bf16, and each projection saves its own bf16 cast of its input
    (q, k, v: 3 H; gate, up: 2 H). That split is derived, not yet checked on a GPU
    (benchmarks/gpu_check.py prints the measured peak beside the plan's)."""
    h, i, kv = arch.hidden, arch.intermediate, arch.kv_width
    if not cuda:
        return 4 * (8 * h + 4 * i + 2 * kv + arch.heads + 2)
    return 4 * (6 * h + 2) + 2 * (2 * h + 4 * i + 2 * kv) + 4 * arch.heads + 2 * 5 * h


def disk(n: int, trained: int, options: PlanOptions, half: int = 4) -> dict:
    """A checkpoint holds the fp32 weights trained (with LoRA its adapter) and AdamW's moments;
    only the newest keeps the moments (resume needs no older ones), and --save-total-limit keeps
    the newest few. The final model is whole: fp32, or with LoRA merged into the base's dtype."""
    saves = math.ceil(options.steps / options.save_every)
    kept = min(saves, options.save_total_limit or saves)
    weights, moments = 4 * trained, 8 * trained
    final = half * n if options.lora_rank else 4 * n
    return {"checkpoint": weights + moments, "run": kept * weights + moments + final, "kept": kept}


def engine_memory(p: dict, card_bytes: float) -> dict:
    """The vLLM engine's bytes while it samples on a card of card_bytes (all 0 without one): its
    weights, its CUDA graphs, and the KV cache it is given in bytes (kv_cache_memory_bytes): every
    row of the step at its longest, or what its share of the card leaves after weights and graphs,
    whichever is less ("group": what one group's G rows need, the least it must hold)."""
    if not p["engine_share"]:
        return {"weights": 0, "graphs": 0, "kv_cache": 0, "group": 0, "total": 0}
    kv_cache = engine_kv_cache(
        p["engine_row_kv"], p["n_rows"], p["engine_weights"], p["engine_share"], card_bytes
    )
    out = {"weights": p["engine_weights"], "graphs": CUDA_GRAPHS, "kv_cache": kv_cache}
    return out | {"group": p["group_size"] * p["engine_row_kv"], "total": sum(out.values())}


def engine_kv_cache(row_kv: int, n_rows: int, weights: int, share: float, card_bytes: float) -> int:
    """The bytes of KV cache the vLLM engine is given on a card (vllm_engine.py pins it): n_rows
    rows of row_kv bytes each, or what `share` of card_bytes leaves after its weights and CUDA
    graphs, whichever is less."""
    return int(max(0, min(n_rows * row_kv, share * card_bytes - weights - CUDA_GRAPHS)))


def holds(p: dict, card_bytes: float, free_bytes: float | None = None) -> bool:
    """Whether a card of card_bytes (free_bytes of it free, else USABLE of it) holds the plan p:
    every phase, the rollout's beside the vLLM engine, whose share of the card must leave it a KV
    cache of at least one group."""
    usable = USABLE * card_bytes if free_bytes is None else free_bytes
    engine = engine_memory(p, card_bytes)
    if engine["kv_cache"] < engine["group"]:
        return False
    return needed(p, card_bytes) <= usable


def needed(p: dict, card_bytes: float) -> float:
    """The bytes the plan p needs at once on a card of card_bytes: its peak, or its rollout
    phase beside the vLLM engine while it samples."""
    return max(p["peak"], p["phases"]["rollout"] + engine_memory(p, card_bytes)["total"])


def fits(p: dict) -> tuple[list[int], list[int]]:
    """The common card sizes (GB) that hold the plan p, and those that do not."""
    hold = [size for size in GPU_SIZES_GB if holds(p, size * GB)]
    return hold, [size for size in GPU_SIZES_GB if size not in hold]


def card_precision(options: PlanOptions, capability: tuple[int, int], card: str) -> str:
    """The precision a run of `options` runs in on a card: auto's choice, or the one asked for."""
    return (
        capability_choice(*capability, card)[0]
        if options.precision == "auto"
        else options.precision
    )


def cards_table(p: dict, options: PlanOptions) -> list[str]:
    """A line per card size: whether the plan fits it, and its cards with the precision each
    would run (bf16 and fp16 hold the same bytes)."""
    lines = []
    for size in GPU_SIZES_GB:
        named = {}
        for card, gigabytes, capability in CARDS:
            if gigabytes == size:
                named.setdefault(card_precision(options, capability, card), []).append(card)
        cards = "; ".join(f"{', '.join(names)} ({name})" for name, names in named.items())
        verdict = "fits" if holds(p, size * GB) else "does not fit"
        lines.append(f"  {size:4d} GB  {verdict:13s} {cards}")
    return lines


def report(model: str, options: PlanOptions) -> str:
    """--plan's text: parameters, items, phases, disk, and which cards the run fits."""
    p = plan(model, options)
    precision = "fp32" if options.precision == "fp32" else "bf16 or fp16"
    lines = [
        f"{model}: {p['parameters']:,} parameters; {p['n_rows']} rows of up to "
        f"{p['positions']:,} positions a step",
        f"memory (CUDA, {precision} autocast):" if precision != "fp32" else "memory (CUDA, fp32):",
    ]
    lines += [f"  {name:32s} {size / GB:8.2f} GB" for name, size in p["items"].items() if size]
    lines += [f"  peak in {name:24s} {size / GB:8.2f} GB" for name, size in p["phases"].items()]
    if p["engine_share"]:
        kv_cache = p["n_rows"] * p["engine_row_kv"]
        lines.append(
            f"  vLLM engine while sampling, within {p['engine_share']:.0%} of the card: its "
            f"weights {p['engine_weights'] / GB:.2f} GB, CUDA graphs up to {CUDA_GRAPHS / GB:.0f} "
            f"GB, a KV cache of up to {kv_cache / GB:.2f} GB (every row at its longest); asleep "
            "in the update, holding none"
        )
    d = p["disk"]
    lines.append(
        f"disk: {d['checkpoint'] / GB:.1f} GB a checkpoint (the newest, with AdamW's "
        f"moments; older ones keep only weights), {d['run'] / GB:.1f} GB a run "
        f"({d['kept']} checkpoints and final-model)"
    )
    hold, not_hold = fits(p)
    lines.append(f"fits: {sizes(hold)}; does not fit: {sizes(not_hold)}")
    lines.append(
        f"cards (--precision {options.precision}: bf16 from compute capability 8.0, fp16 on 7.x):"
    )
    return "\n".join(lines + cards_table(p, options))


def sizes(gigabytes: list[int]) -> str:
    return f"{', '.join(map(str, gigabytes))} GB" if gigabytes else "none of them"


def memory_levers(options: PlanOptions) -> list[tuple[str, dict]]:
    """The run's memory options, each turned down one notch, in the order they cost least: each
    (its flag, the change), cumulatively worth trying. None changes the recipe but LoRA's and the
    completion limit's."""
    levers = []
    if not options.gradient_checkpointing:
        levers.append(("--gradient-checkpointing", dict(gradient_checkpointing=True)))
    if options.groups_per_micro_batch != 1:
        levers.append(("--groups-per-micro-batch 1", dict(groups_per_micro_batch=1)))
    chunk = min(options.rollout_chunk or options.prompts_per_step, options.prompts_per_step)
    while chunk > 1:
        chunk //= 2
        levers.append((f"--rollout-chunk {chunk}", dict(rollout_chunk=chunk)))
    if not options.lora_rank:
        levers.append(("--lora-rank 32", dict(lora_rank=32)))
    length = options.max_completion_length
    while length > 1024:
        length //= 2
        levers.append((f"--max-completion-length {length}", dict(max_completion_length=length)))
    return levers


def what_fits(model: str, options: PlanOptions, card: tuple, recipes: dict) -> str:
    """What would fit a card of (total, free) bytes: the recipes (name -> the (Config, RunConfig)
    of one of cwgrpo's presets) of the same model that fit, else of any; and the fewest of the
    run's own levers that fit."""
    total, free = card
    share = engine_share_that_fits(plan(model, options), total, free)
    if share is not None:  # the engine's share is what does not fit: the one that does
        p = plan(model, dataclasses.replace(options, vllm_gpu_memory_utilization=share))
        engine = engine_memory(p, total)["total"]
        return (
            f"--vllm-gpu-memory-utilization {share:.2f} fits (the engine {engine / GB:.1f} GB "
            f"while it samples; the trainer {p['peak'] / GB:.1f} GB at its peak while it sleeps)"
        )
    plans = {name: plan(pair[0].model, PlanOptions.of(*pair)) for name, pair in recipes.items()}
    fitting = [(name, needed(p, total)) for name, p in plans.items() if holds(p, total, free)]
    same = [(name, size) for name, size in fitting if recipes[name][0].model == model]
    found = [f"--preset {name} fits ({size / GB:.1f} GB)" for name, size in (same or fitting)[:2]]
    changes, flags = {}, {}  # the levers that lower the need, each option's latest value
    need = needed(plan(model, options), total)
    for flag, change in memory_levers(options):
        trial = plan(model, dataclasses.replace(options, **(changes | change)))
        if needed(trial, total) < need:
            changes |= change
            flags |= {next(iter(change)): flag}
            need = needed(trial, total)
            if holds(trial, total, free):
                lora = " (LoRA wants 10x the learning rate)" if "lora_rank" in flags else ""
                found.append(f"{' '.join(flags.values())} fits ({need / GB:.1f} GB){lora}")
                break
    return "; ".join(found) or "nothing short of a larger card"


def engine_share_that_fits(p: dict, total: float, free: float) -> float | None:
    """The least --vllm-gpu-memory-utilization, in steps of 0.05, at which the plan p holds a card
    of total bytes, free of them free; None without an engine, or where no share does."""
    if not p["engine_share"]:
        return None
    shares = [hundredths / 100 for hundredths in range(5, 100, 5)]
    return next((s for s in shares if holds(p | {"engine_share": s}, total, free)), None)


def check_fit(
    model: str, options: PlanOptions, free_bytes: int, total_bytes: int, recipes: dict | None = None
) -> None:
    """Stop before loading when the plan does not fit the GPU's free memory (its total sizes the
    vLLM engine's share): one line naming what does not fit (the largest items, or the engine's
    share too small for a group's KV cache), and the engine share, the presets (recipes: name ->
    its (Config, RunConfig)) or the fewest flags that fit this card."""
    p = plan(model, options)
    if holds(p, total_bytes, free_bytes):
        return
    engine = engine_memory(p, total_bytes)
    fit = what_fits(model, options, (total_bytes, free_bytes), recipes or {})
    if engine["kv_cache"] < engine["group"]:
        share = p["engine_share"]
        problem = (
            f"--vllm-gpu-memory-utilization {share:.2f} gives the vLLM engine "
            f"{share * total_bytes / GB:.1f} GB of this {total_bytes / GB:.1f} GB card, which "
            f"leaves its KV cache {engine['kv_cache'] / GB:.2f} GB beside its weights and CUDA "
            f"graphs, less than one group's {engine['group'] / GB:.2f} GB"
        )
    else:
        largest = sorted(p["items"].items(), key=lambda item: -item[1])[:3]
        named = ", ".join(f"{name} {size / GB:.1f} GB" for name, size in largest)
        problem = (
            f"this run needs about {needed(p, total_bytes) / GB:.1f} GB and the GPU has "
            f"{free_bytes / GB:.1f} GB free (largest: {named})"
        )
    raise SystemExit(
        f"error: {problem}; on this card: {fit}; python cwgrpo.py ... --plan shows the whole plan"
    )


def check_fit_on_gpu(model: str, options: PlanOptions, recipes: dict) -> None:
    """check_fit on this process's CUDA card, its free and total memory as CUDA reports them."""
    free, total = torch.cuda.mem_get_info()
    check_fit(model, options, free_bytes=free, total_bytes=total, recipes=recipes)


class OutOfMemory:
    """Running out of GPU memory in a phase of a run's step, turned into one line: the phase and
    the step, the plan's peak for it, the option that lowers it with the plan's figure for what
    it shrinks, the newest checkpoint (intact) and the command that resumes with that option, or
    before the first checkpoint the command that starts afresh with it (a resume may change the
    memory options, not the recipe)."""

    def __init__(self, model: str, options: PlanOptions, output_dir: Path):
        self.model, self.options, self.output_dir = model, options, Path(output_dir)

    @contextlib.contextmanager
    def phase(self, name: str, step: int):
        try:
            yield
        except torch.OutOfMemoryError:
            raise SystemExit(self.message(name, step)) from None

    def lever(self, name: str, items: dict) -> tuple[str, str]:
        """The flag a resume can take to lower the phase's peak, and what it lowers."""
        o = self.options
        n_groups = o.groups_per_micro_batch or o.prompts_per_step
        if name == "sampling" and o.rollout == "vllm":
            share = o.vllm_gpu_memory_utilization
            flag = f"--vllm-gpu-memory-utilization {max(0.1, share - 0.1):.1f}"
            return flag, f"the engine holds {share:.0%} of the card as it samples"
        if name == "sampling" and o.sampled_rows > o.group_size:
            prompts = o.sampled_rows // o.group_size
            kv = items["KV cache"] / GB
            return f"--rollout-chunk {prompts // 2}", f"{prompts} prompts' KV cache, {kv:.1f} GB"
        if name == "the update" and not o.gradient_checkpointing:
            saved = items["activations saved for backward"] / GB
            return "--gradient-checkpointing", f"{saved:.1f} GB of activations saved for backward"
        if name in ("the update", "the log-prob passes") and n_groups > 1:
            return "--groups-per-micro-batch 1", f"{n_groups} groups a pass"
        return "", ""

    def message(self, name: str, step: int) -> str:
        p = plan(self.model, self.options)
        phase = {"sampling": "rollout", "the optimizer step": "optimizer step"}.get(name, "update")
        flag, lowers = self.lever(name, p["items"])
        advice = f"lower it with {flag} (now {lowers})" if flag else "no memory option lowers it"
        if name == "the optimizer step" and not self.options.lora_rank:
            advice += ": a new run under LoRA (the -lora presets) holds AdamW's moments of less"
        elif name != "the optimizer step":
            limit = self.options.max_completion_length
            advice += f", or a new run with --max-completion-length below {limit}"
        go_on = checkpoints.how_to_continue(self.output_dir, flag=flag)
        return (
            f"error: out of GPU memory in {name} at step {step} (the plan's peak there: "
            f"{p['phases'][phase] / GB:.1f} GB); {advice}; {go_on}"
        )
