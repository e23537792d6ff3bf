"""What cwgrpo draws: a run's curves, the ablation's and the diagnostics' figures, and the intervals
they draw (a run's printed header and summary are run.py's). matplotlib is loaded only when
something is drawn, so `import cwgrpo` loads no plotting library."""

import math
import statistics
from pathlib import Path

from cwgrpo_utils.run.folder import never_fatal, read_records


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
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


T_975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
]  # Student t, df = 1 .. 20


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% Student-t interval (NaN, undefined, for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    t = T_975[len(values) - 2] if len(values) <= len(T_975) + 1 else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def cell(values: list[float], digits: int = 3) -> str:
    """Mean ± the half-width of its 95% interval, as the tables print it."""
    mean, half = interval(values)
    return f"{mean:.{digits}f} ± {plus_minus(half, digits)}"


def plus_minus(half: float, digits: int) -> str:
    """An interval's half-width; n/a where one seed leaves it undefined."""
    return "n/a" if math.isnan(half) else f"{half:.{digits}f}"


# The values a curve can take: an interval for its mean is cut to them (a Student-t interval over
# two seeds is wide, and accuracy below 0 or entropy below 0 is nothing a run can show)
METRIC_RANGES = {"accuracy": (0.0, 1.0), "entropy": (0.0, math.inf)}


def band(mean: list[float], half: list[float], key: str) -> tuple[list[float], list[float]]:
    """The lower and upper edges of mean ± half, within the metric's range."""
    low, high = METRIC_RANGES.get(key, (-math.inf, math.inf))
    return [max(low, m - h) for m, h in zip(mean, half)], [
        min(high, m + h) for m, h in zip(mean, half)
    ]


def plot_ablation(path: Path, curves: dict, title: str) -> None:
    """Curves per method, side by side: the mean over seeds of the 10-step moving average, with
    its 95% interval as a band, cut to the metric's range. curves: method -> {panel name: [one
    list per seed]}."""
    plt = pyplot()
    panels = list(next(iter(curves.values())))
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8))
    for method, per_panel in curves.items():
        for axis, key in zip(axes, panels):
            runs = per_panel[key]
            length = min(map(len, runs))
            smoothed = [moving_average(run[:length]) for run in runs]
            mean, half = zip(*(interval(list(values)) for values in zip(*smoothed)))
            steps = range(1, length + 1)
            (line,) = axis.plot(steps, mean, label=method, linewidth=1.2)
            axis.fill_between(steps, *band(mean, half, key), color=line.get_color(), alpha=0.12)
    for axis, key in zip(axes, panels):
        axis.set(xlabel="rollout step", ylabel=f"{key} (10-step mean)")
        axis.grid(alpha=0.3)
    axes[-1].legend(fontsize=8, ncol=2)
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
        (line,) = right.plot(diag_steps, positive, marker="o", label=f"{name} +")
        right.plot(
            diag_steps,
            negative,
            marker="v",
            linestyle="--",
            color=line.get_color(),
            label=f"{name} -",
        )
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
        axis.plot(
            list(table),
            [table[s][name]["pass@1"] for s in table],
            marker="o",
            label=names.get(name, name),
        )
    axis.set(xlabel="training step", ylabel="pass@1 (%)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def first_to_last(records: list[dict], key: str) -> tuple[float, float]:
    """The mean of `key` over the first and over the last 10% of the records (at least one)."""
    tail = max(1, len(records) // 10)
    return (
        statistics.fmean(r[key] for r in records[:tail]),
        statistics.fmean(r[key] for r in records[-tail:]),
    )


def plot_run(metrics_path: Path, path: Path, title: str) -> None:
    """One small figure of a run's curves: reward and accuracy, entropy, KL, the weights."""
    records = read_records(metrics_path)
    steps = [r["step"] for r in records]
    plt = pyplot()
    figure, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    panels = [
        (axes[0, 0], "reward and accuracy", ("reward_mean", "accuracy_mean", "format_mean")),
        (axes[0, 1], "entropy (nats)", ("entropy_mean",)),
        (axes[1, 0], "KL to the reference (k3)", ("kl_mean",)),
        (axes[1, 1], "share of tokens", ("w_frac_below_half", "w_frac_above_2", "touched_frac")),
    ]
    for axis, label, keys in panels:
        for key in keys:
            values = [r[key] for r in records]
            (line,) = axis.plot(steps, values, linewidth=0.6, alpha=0.35)
            axis.plot(
                steps,
                moving_average(values),
                color=line.get_color(),
                linewidth=1.5,
                label=key.removesuffix("_mean"),
            )
        axis.set(ylabel=label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="best")
    for axis in axes[1]:
        axis.set(xlabel="optimizer step")
    figure.suptitle(f"{title} (thin: per step; thick: 10-step mean)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def draw_curves(output_dir: Path, title: str) -> None:
    """A run's curves.png, redrawn from its metrics.jsonl. A picture never costs the run: a
    failure warns once, in one line, and the run trains on."""
    with never_fatal("draw curves.png"):
        plot_run(output_dir / "metrics.jsonl", output_dir / "curves.png", title)
