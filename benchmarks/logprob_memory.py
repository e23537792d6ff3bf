"""Peak memory of log-probs + entropy + backward through the LM head: cwgrpo's chunked path against
the direct full-logits computation, on CPU with just an LM head (no transformer layers).

    python -m benchmarks.logprob_memory    # Qwen's vocab 151,936, hidden 1,536, 2 x 2,048 tokens

Each path runs in its own process, so each peak (the growth of the process's maximum resident set
during the computation) is measured from the same starting point. Both processes save their results,
compared at the end. Goal (issue 6): the chunked peak at most a quarter of the direct one, with
identical results.
"""

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cwgrpo_utils.fast.lm_head import chunked_logprobs
from cwgrpo_utils.options.run_config import RunConfig


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def direct_logprobs(hidden, weight, targets, temperature):
    """What one writes without chunking: the whole (positions, vocab) logits at once."""
    logp_all = (hidden @ weight.T).float().div(temperature).log_softmax(-1)
    entropy = -(logp_all.detach().exp() * logp_all.detach()).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


def run_one(path: str, args, out: Path) -> None:
    torch.manual_seed(0)
    positions = args.completions * args.tokens
    hidden = torch.randn(positions, args.hidden).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    targets = torch.randint(args.vocab, (positions,))
    upstream = torch.randn(positions)  # the loss's gradient with respect to each log-prob
    start_mib, start = peak_rss_mib(), time.perf_counter()
    if path == "chunked":
        logp, entropy = chunked_logprobs(hidden, weight, targets, 0.7, args.chunk_elements)
    else:
        logp, entropy = direct_logprobs(hidden, weight, targets, 0.7)
    (logp * upstream).sum().backward()
    seconds = time.perf_counter() - start
    projection = torch.randn(args.hidden, generator=torch.Generator().manual_seed(1))
    torch.save(
        {
            "peak_mib": peak_rss_mib() - start_mib,
            "seconds": seconds,
            "logp": logp.detach(),
            "entropy": entropy,
            "hidden_grad": hidden.grad,
            "weight_grad_projection": weight.grad @ projection,
        },
        out,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1_536)
    parser.add_argument("--tokens", type=int, default=2_048, help="tokens per completion")
    parser.add_argument("--completions", type=int, default=2, help="completions in the micro-batch")
    parser.add_argument("--chunk-elements", type=int, default=RunConfig.logit_chunk_elements)
    parser.add_argument("--path", choices=["chunked", "direct"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.path:
        return run_one(args.path, args, Path(args.out))

    print(
        f"vocab {args.vocab}, hidden {args.hidden}, {args.completions} completions x "
        f"{args.tokens} tokens, chunks of {args.chunk_elements} logits "
        f"({max(1, args.chunk_elements // args.vocab)} positions)"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in ("direct", "chunked"):
            out = Path(tmp) / f"{path}.pt"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    __spec__.name,
                    *sys.argv[1:],
                    "--path",
                    path,
                    "--out",
                    str(out),
                ],
                check=True,
            )
            results[path] = torch.load(out, weights_only=True)  # tensors and numbers only
            print(
                f"{path:8s} peak +{results[path]['peak_mib']:8.0f} MiB   "
                f"{results[path]['seconds']:6.2f} s"
            )
    direct, chunked = results["direct"], results["chunked"]
    for key in ("logp", "entropy", "hidden_grad", "weight_grad_projection"):
        difference = (direct[key] - chunked[key]).abs().max().item()
        print(
            f"max |direct - chunked| of {key}: {difference:.2e} "
            f"(largest value {direct[key].abs().max().item():.3g})"
        )
        scale = direct[key].abs().max().item()
        assert difference <= 1e-5 * max(1.0, scale), (
            f"{key} differs by {difference} (scale {scale})"
        )
    ratio = chunked["peak_mib"] / direct["peak_mib"]
    print(
        f"chunked / direct peak memory: {ratio:.3f} "
        f"(goal <= 0.25: {'met' if ratio <= 0.25 else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
