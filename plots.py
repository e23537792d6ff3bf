"""plots.py: what cwgrpo shows a person: its figures, the token page, a run's summary, and the
intervals they draw. It knows nothing of cwgrpo (cwgrpo.py's loop calls it) and loads matplotlib
only when it draws, so `import cwgrpo` stays free of plotting libraries."""

import codecs
import html
import json
import math
import statistics
from pathlib import Path

from transformers.convert_slow_tokenizer import bytes_to_unicode

from runtime import checkpoint_step, checkpoints, never_fatal, read_records


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


def plot_ablation(path: Path, curves: dict, title: str) -> None:
    """Curves per method, side by side: the mean over seeds of the 10-step moving average, with
    its 95% interval as a band. curves: method -> {panel name: [one list per seed]}."""
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
            axis.fill_between(
                steps,
                [m - h for m, h in zip(mean, half)],
                [m + h for m, h in zip(mean, half)],
                color=line.get_color(),
                alpha=0.12,
            )
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


SUMMARY_KEYS = ("reward_mean", "accuracy_mean", "format_mean", "entropy_mean", "kl_mean")


def run_summary(output_dir: Path, wall_s: float, temperature: float, evaluate_command: str) -> str:
    """What a run did, in a few lines: first -> last 10% of each curve, its wall time, and where
    its checkpoints, final model and pictures are."""
    records = read_records(output_dir / "metrics.jsonl")
    out = [
        f"done in {wall_s:.0f} s; first -> last 10% of {len(records)} steps "
        f"(completions sampled at temperature {temperature:g}):"
    ]
    for key in SUMMARY_KEYS:
        first, last = first_to_last(records, key)
        out.append(f"  {key.removesuffix('_mean'):9s} {first:8.3f} -> {last:.3f}")
    kept = sorted(checkpoints(output_dir), key=checkpoint_step)
    return "\n".join(
        out
        + [
            f"checkpoints: {', '.join(map(str, kept))}",
            f"final model: {output_dir / 'final-model'}",
            f"pictures:    {output_dir / 'curves.png'} and {output_dir / 'tokens.html'}",
            f"evaluate it: {evaluate_command} (at evaluate.py's own --temperature, which its "
            "results state)",
        ]
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


TOKEN_PAGE_STYLE = """
body { font: 14px/1.5 system-ui, sans-serif; margin: 1.5em; max-width: 70em; color: #222; }
.completion { font-family: ui-monospace, monospace; white-space: pre-wrap; border: 1px solid #ddd;
  padding: .5em; margin: .4em 0; }
.t { border-radius: 2px; }
.touched { text-decoration: underline dotted 2px; }
.legend span { display: inline-block; padding: 0 .5em; margin-right: .3em; }
.meta { color: #666; font-size: 12px; }
"""

TOKEN_PAGE_SCRIPT = """
const data = JSON.parse(document.getElementById("data").textContent);
function colour(w) {
  if (w === 0) return "#bbbbbb";
  if (w < 1) { const a = Math.min(1, 1 - w); return `rgba(40, 100, 230, ${0.15 + 0.7 * a})`; }
  if (w > 1) { const a = Math.min(1, (w - 1) / 2); return `rgba(240, 140, 20, ${0.15 + 0.7 * a})`; }
  return "transparent";
}
function show(method) {
  for (const [v, view] of data.views.entries()) {
    document.querySelectorAll(`[data-view="${v}"] .t`).forEach(span => {
      const [i, t] = span.dataset.it.split(",").map(Number);
      const w = view.weights[method][i][t], touched = view.touched[method][i][t];
      span.style.background = colour(w);
      span.classList.toggle("touched", touched === 1);
      span.title = `p = ${view.prob[i][t].toPrecision(3)}, covariance score = ` +
        `${view.cov[i][t].toPrecision(3)}, advantage = ${view.adv[i].toPrecision(3)}, ` +
        `${method} weight = ${w.toPrecision(3)}${touched ? " (touched)" : ""}`;
    });
  }
}
document.getElementById("method").addEventListener("change", e => show(e.target.value));
show(data.method);
"""


def token_view(
    label: str, tokenizer, completion_ids, mask, logp, cov, adv, weights: dict, touched: dict
) -> dict:
    """One step's view for token_page, from a group's (G, T) tensors: the shown completions'
    tokens (as many as completion_ids has), each token's probability, covariance score and every
    method's weight and touched flag, and each completion's advantage; rounded to 4 digits."""
    lengths = mask.sum(1).long().tolist()[: len(completion_ids)]

    def rows(values) -> list[list[float]]:
        return [[float(f"{v:.4g}") for v in row[:n].tolist()] for row, n in zip(values, lengths)]

    return {
        "label": label,
        "tokens": [
            token_texts(tokenizer, ids[:n].tolist()) for ids, n in zip(completion_ids, lengths)
        ],
        "prob": rows(logp.exp()),
        "cov": rows(cov),
        "adv": [round(a, 4) for a in adv[: len(lengths)].tolist()],
        "weights": {k: rows(w) for k, w in weights.items()},
        "touched": {k: rows(t.int()) for k, t in touched.items()},
    }


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text. A byte-level BPE token can hold part of a UTF-8 character, which alone
    decodes to U+FFFD; an incremental decoder gives the character to the token that completes it,
    and the tokens before it show a middle dot."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    pieces = tokenizer.convert_ids_to_tokens(ids)
    if not all(isinstance(p, str) and all(ch in byte_of for ch in p) for p in pieces):
        return [tokenizer.decode([t]) for t in ids]  # not byte-level: decode token by token
    special = set(tokenizer.all_special_ids)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    texts = []
    for token, piece in zip(ids, pieces):
        if token in special:
            texts.append(tokenizer.decode([token]))
            continue
        texts.append(decoder.decode(bytes(byte_of[ch] for ch in piece)) or "\u00b7")
    return texts


def token_page(
    path: Path, title: str, method: str, methods: dict, views: list[dict], note: str = ""
) -> None:
    """A self-contained page of sampled completions, each token coloured by the weight a method
    gives it; a selector shows any other method on the same tokens. views: one per step, each
    {"label", "tokens" (a list of token strings per completion), "prob", "cov" (per token),
    "adv" (per completion), "weights" and "touched" (method -> per token)}. Token text is model
    output, so it is escaped; the data travels as JSON with "</" escaped."""
    body = []
    for v, view in enumerate(views):
        body.append(f'<h2>{html.escape(view["label"])}</h2><div data-view="{v}">')
        for i, tokens in enumerate(view["tokens"]):
            spans = "".join(
                f'<span class="t" data-it="{i},{t}">{html.escape(token)}</span>'
                for t, token in enumerate(tokens)
            )
            body.append(
                f'<p class="meta">completion {i + 1}, advantage '
                f'{view["adv"][i]:+.3f}</p><div class="completion">{spans}</div>'
            )
        body.append("</div>")
    options = "".join(
        f'<option value="{html.escape(name)}"{" selected" * (name == method)}>'
        f"{html.escape(name)}: {html.escape(about)}</option>"
        for name, about in methods.items()
    )
    data = json.dumps(
        {
            "method": method,
            "views": [
                {k: view[k] for k in ("prob", "cov", "adv", "weights", "touched")} for view in views
            ],
        },
        separators=(",", ":"),
    ).replace("</", "<\\/")
    legend = (
        '<p class="legend"><span style="background:rgba(40,100,230,.6)">w &lt; 1: turned '
        'down</span><span style="border:1px solid #ccc">w = 1</span><span style="background:'
        'rgba(240,140,20,.6)">w &gt; 1: turned up</span><span style="background:#bbb">w = 0: '
        'silenced</span><span class="touched">dotted underline: loss changed by the method</span>'
        " Hover a token for its probability, covariance score, advantage and weight. A middle "
        "dot is a token holding the first bytes of a character the next token completes."
        f"{' ' + html.escape(note) if note else ''}</p>"
    )
    Path(path).write_text(
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>'
        f"{html.escape(title)}</title><style>{TOKEN_PAGE_STYLE}</style></head><body>"
        f'<h1>{html.escape(title)}</h1><p><label>Weights of <select id="method">{options}'
        f'</select></label></p>{legend}{"".join(body)}<script type="application/json" id="data">'
        f"{data}</script><script>{TOKEN_PAGE_SCRIPT}</script></body></html>\n"
    )


def draw_run(
    output_dir: Path, title: str, method: str, methods: dict, views: list[dict], note: str = ""
) -> None:
    """A run's curves.png and tokens.html (token_page's arguments). A picture never costs the
    run: either failing warns once, in one line, and the run trains on."""
    with never_fatal("draw curves.png"):
        plot_run(output_dir / "metrics.jsonl", output_dir / "curves.png", title)
    with never_fatal("write tokens.html"):
        token_page(output_dir / "tokens.html", title, method, methods, views, note)
