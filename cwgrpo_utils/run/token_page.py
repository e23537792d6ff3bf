"""tokens.html: a self-contained page of a run's sampled completions, each token coloured by the
weight a method gives it, with a selector for every other method's weights on the same tokens.
TokenPage draws it from inside a run, as a hook of cwgrpo.py's training loop."""

import codecs
import html
import json
import unicodedata
from pathlib import Path
from typing import Callable

from transformers.convert_slow_tokenizer import bytes_to_unicode

from cwgrpo_utils.run.checkpoints import rng_kept
from cwgrpo_utils.run.folder import append_record, keep_records_until, never_fatal, read_records

# What the legend adds under the released CW reading
CW_NOTE = (
    "cw as released normalises its weights over padded positions, so their mean over real tokens "
    "is above 1 and most tokens show orange."
)


class TokenPage:
    """A run's tokens.html: at its first and its last step, one group's prompt and a few of its
    completions, each token coloured by the weight that every update pass of every method gives
    it. A hook of the training loop, called with each scored batch; `weigh(model, rows, cfg,
    log_prob_passes)` (cwgrpo.py's every_methods_weights) gives the weights. The views are kept in
    the run's tokens.jsonl, a record a step, so a resumed run keeps its first step's; a page that
    cannot be drawn warns once and the run trains on."""

    def __init__(self, run, cfg, tokenizer, methods: dict, weigh: Callable, log_prob_passes):
        self.path = run.path
        self.views = run.path / "tokens.jsonl"
        keep_records_until(self.views, run.resumed_step)  # the steps a resume redoes go
        self.cfg, self.tokenizer, self.weigh = cfg, tokenizer, weigh
        self.log_prob_passes = log_prob_passes
        self.shown = shown_passes(methods)
        self.title = f"{cfg.method} on {cfg.model}, seed {cfg.seed}"

    def __call__(self, rollout_step: int, model, batch, autocast) -> None:
        if rollout_step not in (1, self.cfg.steps):
            return
        with never_fatal("draw the token page"):
            rows = batch.select(0, self.cfg.group_size)
            with rng_kept(), autocast():  # clip_cov draws at random: training goes on unchanged
                weighed = self.weigh(model, rows, self.cfg, self.log_prob_passes)
            label = f"step {rollout_step}"
            record = view(label, self.tokenizer, rows, weighed, self.shown)
            append_record(self.views, {"rollout_step": rollout_step, **record})
        with never_fatal("write tokens.html"):
            about = {shown: text for shown, *_, text in self.shown}
            note = CW_NOTE if self.cfg.cw_norm == "padded" else ""
            views = read_records(self.views)
            write(self.path / "tokens.html", self.title, self.cfg.method, about, views, note)


STYLE = """
body { font: 14px/1.5 system-ui, sans-serif; margin: 1.5em; max-width: 70em; color: #222; }
.completion { font-family: ui-monospace, monospace; white-space: pre-wrap; border: 1px solid #ddd;
  padding: .5em; margin: .4em 0; }
.t { border-radius: 2px; }
.touched { text-decoration: underline dotted 2px; }
.legend span { display: inline-block; padding: 0 .5em; margin-right: .3em; }
.meta { color: #666; font-size: 12px; }
.prompt { font-family: ui-monospace, monospace; white-space: pre-wrap; background: #f6f6f6;
  padding: .5em; }
"""

SCRIPT = """
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
        `${view.score[i][t].toPrecision(3)}, advantage = ${view.adv[i].toPrecision(3)}, ` +
        `${method} weight = ${w.toPrecision(3)}${touched ? " (touched)" : ""}`;
    });
  }
}
document.getElementById("method").addEventListener("change", e => show(e.target.value));
show(data.method);
"""


def shown_passes(methods: dict) -> list[tuple[str, str, int, str]]:
    """(name shown, method, update pass, description) of every update pass of every method, from
    method -> its description and update_passes: lopti's two passes are two views of the page."""
    shown = []
    for name, method in methods.items():
        description, update_passes = method.description, method.update_passes
        shown.append((name, name, 0, description + " (pass 1)" * (update_passes > 1)))
        for p in range(1, update_passes):
            shown.append(
                (
                    f"{name}, pass {p + 1}",
                    name,
                    p,
                    f"{name}'s pass {p + 1}, on the tokens pass 1 left out",
                )
            )
    return shown


def view(label: str, tokenizer, rows, weighed: dict, shown_passes: list, shown: int = 4) -> dict:
    """One step's view for write(), from a scored group's rows (a cwgrpo Rollout: its prompt,
    completions, rewards, accuracy, advantages) and weighed, cwgrpo's every_methods_weights of
    them: the prompt, the first `shown` completions' tokens, each token's probability, covariance
    score and every pass's weight and touched flag, and each completion's advantage and reward and
    whether it is right (accuracy 1); rounded to 4 digits."""
    mask = rows.completion_mask
    lengths = mask.sum(1).long().tolist()[:shown]

    def per_token(values) -> list[list[float]]:
        return [[float(f"{v:.4g}") for v in row[:n].tolist()] for row, n in zip(values, lengths)]

    prompt = tokenizer.decode(rows.prompt_ids[0, rows.prompt_mask[0].bool()])
    completions = [ids[:n].tolist() for ids, n in zip(rows.completion_ids, lengths)]
    weights = {name: weighed[method, p] for name, method, p, _ in shown_passes}
    return {
        "label": label,
        "prompt": visible(prompt),
        "group_size": len(mask),
        "reward": [round(r, 4) for r in rows.rewards[: len(lengths)].tolist()],
        "correct": [a == 1 for a in rows.accuracy[: len(lengths)].tolist()],
        "tokens": [token_texts(tokenizer, ids) for ids in completions],
        "prob": per_token(weighed["logp"].exp()),
        "score": per_token(weighed["score"]),
        "adv": [round(a, 4) for a in rows.advantages[: len(lengths)].tolist()],
        "weights": {name: per_token(w) for name, (w, _) in weights.items()},
        "touched": {name: per_token(t.int()) for name, (_, t) in weights.items()},
    }


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text. A byte-level BPE token can hold part of a UTF-8 character, which alone
    decodes to U+FFFD; an incremental decoder gives the character to the token that completes it,
    and the tokens before it show a middle dot."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    pieces = tokenizer.convert_ids_to_tokens(ids)
    if not all(isinstance(p, str) and all(ch in byte_of for ch in p) for p in pieces):
        return [visible(tokenizer.decode([t])) for t in ids]  # not byte-level: token by token
    special = set(tokenizer.all_special_ids)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    texts = []
    for token, piece in zip(ids, pieces):
        if token in special:
            texts.append(tokenizer.decode([token]))
            continue
        texts.append(visible(decoder.decode(bytes(byte_of[ch] for ch in piece))) or "\u00b7")
    return texts


def visible(text: str) -> str:
    """Control characters other than newline and tab as escapes (\\x00, \\x15, \\x85): a browser
    draws them as empty boxes or nothing at all."""
    return "".join(
        repr(ch)[1:-1] if unicodedata.category(ch) == "Cc" and ch not in "\n\t" else ch
        for ch in text
    )


def write(
    path: Path, title: str, method: str, methods: dict, views: list[dict], note: str = ""
) -> None:
    """A self-contained page of sampled completions, each token coloured by the weight a method
    gives it; a selector shows any other method on the same tokens. views: one per step, each
    {"label", "tokens" (a list of token strings per completion), "prob" and "score" (cw's
    covariance score) per token, "adv" (per completion), "weights" and "touched" (method -> per
    token)}. Token text is model output, so it is escaped; the data travels as JSON with "</"
    escaped."""
    body = []
    for v, view in enumerate(views):
        body.append(f"<h2>{html.escape(view['label'])}</h2>")
        if "prompt" in view:  # views saved before the prompt and scores were shown have none
            shown, group = len(view["tokens"]), view["group_size"]
            body.append(
                f'<p class="meta">the prompt, as the model saw it</p><div class="prompt">'
                f'{html.escape(view["prompt"])}</div><p class="meta">{shown} of the '
                f"group's {group} completions:</p>"
            )
        body.append(f'<div data-view="{v}">')
        for i, tokens in enumerate(view["tokens"]):
            spans = "".join(
                f'<span class="t" data-it="{i},{t}">{html.escape(token)}</span>'
                for t, token in enumerate(tokens)
            )
            graded = ""
            if "reward" in view:
                right = "correct" if view["correct"][i] else "wrong"
                graded = f"reward {view['reward'][i]:g} ({right}), "
            body.append(
                f'<p class="meta">completion {i + 1}, {graded}advantage '
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
                {k: view[k] for k in ("prob", "score", "adv", "weights", "touched")}
                for view in views
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
        f"{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f'<h1>{html.escape(title)}</h1><p><label>Weights of <select id="method">{options}'
        f'</select></label></p>{legend}{"".join(body)}<script type="application/json" id="data">'
        f"{data}</script><script>{SCRIPT}</script></body></html>\n"
    )
