"""plots.py: every figure cwgrpo draws. It knows nothing of cwgrpo (cwgrpo.py's loop may call it)
and loads matplotlib only when it draws, so `import cwgrpo` stays free of plotting libraries."""

import statistics
from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or a one-line error naming the fix."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: plots need matplotlib: pip install -r requirements.txt") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def moving_average(values: list, window: int = 10) -> list:
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def plot_ablation(path: Path, curves: dict, title: str) -> None:
    """Reward and entropy per method: the mean over seeds of the 10-step moving average, +- 1 std
    over seeds. curves: method -> {"reward": [one list per seed], "entropy": [...]}."""
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for method, per_key in curves.items():
        for axis, key in zip(axes, ("reward", "entropy")):
            runs = per_key[key]
            length = min(map(len, runs))
            smoothed = [moving_average(run[:length]) for run in runs]
            mean = [statistics.fmean(values) for values in zip(*smoothed)]
            std = [statistics.stdev(values) if len(values) > 1 else 0.0
                   for values in zip(*smoothed)]
            steps = range(1, length + 1)
            line, = axis.plot(steps, mean, label=method, linewidth=1.2)
            axis.fill_between(steps, [m - s for m, s in zip(mean, std)],
                              [m + s for m, s in zip(mean, std)], color=line.get_color(), alpha=0.12)
    for axis, label in zip(axes, ("reward (10-step mean)", "entropy (10-step mean)")):
        axis.set(xlabel="rollout step", ylabel=label)
        axis.grid(alpha=0.3)
    axes[1].legend(fontsize=8, ncol=2)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_diagnostics(path: Path, runs: dict) -> None:
    """Entropy over steps and the top-0.01% covariance over rollout steps, several runs.
    runs: name -> (steps, entropies, diagnostic steps, top positive, top negative)."""
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, (steps, entropy, diag_steps, positive, negative) in runs.items():
        left.plot(steps, entropy, label=name)
        line, = right.plot(diag_steps, positive, marker="o", label=f"{name} +")
        right.plot(diag_steps, negative, marker="v", linestyle="--", color=line.get_color(),
                   label=f"{name} -")
    left.set(xlabel="step", ylabel="entropy_mean")
    right.set(xlabel="rollout step", ylabel="mean covariance score of the top 0.01%")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_checkpoints(path: Path, table: dict, names: dict) -> None:
    """pass@1 per benchmark over checkpoints. table: step -> benchmark -> {"pass@1": ...}."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name in next(iter(table.values())):
        axis.plot(list(table), [table[s][name]["pass@1"] for s in table], marker="o",
                  label=names.get(name, name))
    axis.set(xlabel="training step", ylabel="pass@1 (%)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
