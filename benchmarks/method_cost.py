"""Cost of each method's token weighting plus the loss, relative to GRPO, at a realistic shape.

    python -m benchmarks.method_cost              # G = 12, completions of up to 4,096 tokens

For every method: the time of its token terms (weights, masks, extra terms) plus the PPO-clip/KL
loss, its aggregation and the backward pass to the log-probs, for one group, the median of --repeats
runs. ict also needs its JS divergence, which reads the full next-token distributions through the LM
head at Qwen's vocabulary; that part is timed separately at --ict-tokens positions (CPU time grows
linearly with them) and set beside the chunked log-prob pass of the same positions, which every
method pays.
"""

import argparse
import dataclasses
import statistics
import time

import torch

import cwgrpo
from cwgrpo_utils.fast.lm_head import chunked_logprobs, ict_divergence


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-size", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=4096, help="longest completion")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1_536)
    parser.add_argument(
        "--ict-tokens", type=int, default=64, help="positions per response for ict's divergence"
    )
    args = parser.parse_args()
    cfg, run_cfg = cwgrpo.parse_config(["--preset", "tiny", "--group-size", str(args.group_size)])
    g = torch.Generator().manual_seed(0)
    G, T = args.group_size, args.tokens
    lengths = torch.randint(T // 4, T + 1, (G,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old_logp = (-(torch.rand(G, T, generator=g) ** 3) * 6) * mask
    ref_logp = old_logp + 0.05 * torch.randn(G, T, generator=g) * mask
    entropy = torch.rand(G, T, generator=g) * 2 * mask
    adv = torch.randn(G, generator=g)
    divergence = torch.rand(G, T, generator=g) * mask
    batch_entropy = (
        torch.cat([entropy[mask.bool()]] * 4).sort().values
    )  # a rollout batch of 4 such groups
    print(
        f"G = {G}, completions of {int(lengths.min())}..{T} tokens ({int(mask.sum())} valid), "
        f"{torch.get_num_threads()} CPU threads, median of {args.repeats}"
    )

    def step(method_name: str):  # one group's terms, loss and backward, as the update's
        one = dataclasses.replace(cfg, method=method_name)
        tokens = cwgrpo.Group(
            old_logp.clone().requires_grad_(True),
            old_logp=old_logp,
            advantages=adv,
            mask=mask,
            entropy=entropy,
            batch_entropy=batch_entropy,
            divergence=divergence,
            update_pass=0,
        )
        loss, _ = cwgrpo.policy_loss(
            tokens,
            cwgrpo.method_terms(tokens, one),
            one,
            sampler_logp=old_logp,
            ref_logp=ref_logp,
            n_responses=G,
            n_tokens=int(mask.sum()),
        )
        loss.backward()

    base = timed(lambda: step("grpo"), args.repeats)
    print(f"{'method':10s} {'ms':>8s} {'x grpo':>7s}")
    for name in cwgrpo.METHODS:
        seconds = base if name == "grpo" else timed(lambda name=name: step(name), args.repeats)
        print(f"{name:10s} {1000 * seconds:8.2f} {seconds / base:7.2f}")

    positions = args.ict_tokens
    hidden = torch.randn(G, positions, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    targets = torch.randint(args.vocab, (G * positions,), generator=g)
    ict_mask = torch.ones(G, positions)
    budget = run_cfg.logit_chunk_elements
    divergence_s = timed(
        lambda: ict_divergence(hidden, weight, ict_mask, 0.7, budget, len(ict_mask)), 2
    )
    logprob_s = timed(
        lambda: chunked_logprobs(hidden.view(-1, args.hidden), weight, targets, 0.7, budget), 2
    )
    scale = mask.sum().item() / (G * positions)
    print(
        f"ict divergence at vocab {args.vocab}, hidden {args.hidden}, {G} x {positions} positions: "
        f"{divergence_s:.2f} s, {divergence_s / logprob_s:.2f} x the chunked log-prob forward "
        f"pass of the same "
        f"positions ({logprob_s:.2f} s); scaled to this group's {int(mask.sum())} tokens: about "
        f"{divergence_s * scale:.0f} s, {divergence_s * scale / base:.0f} x grpo's loss time"
    )


if __name__ == "__main__":
    main()
