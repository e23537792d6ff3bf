"""tokens.html: a self-contained page of a run's sampled completions, each token coloured by the
weight a method gives it, with a selector for every other method's weights on the same tokens."""

import codecs
import html
import json
import unicodedata
from pathlib import Path

from transformers.convert_slow_tokenizer import bytes_to_unicode

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
        `${view.cov[i][t].toPrecision(3)}, advantage = ${view.adv[i].toPrecision(3)}, ` +
        `${method} weight = ${w.toPrecision(3)}${touched ? " (touched)" : ""}`;
    });
  }
}
document.getElementById("method").addEventListener("change", e => show(e.target.value));
show(data.method);
"""


def passes(methods: dict[str, tuple[str, int]]) -> list[tuple[str, str, int, str]]:
    """(name shown, method, update pass, description) of every update pass of every method, from
    method -> (description, update passes): lopti's two passes are two views of the page."""
    shown = []
    for name, (description, update_passes) in methods.items():
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


def view(
    label: str,
    tokenizer,
    prompt: str,
    scores: tuple,
    completion_ids,
    mask,
    logp,
    cov,
    adv,
    weights: dict,
    touched: dict,
) -> dict:
    """One step's view for write(), from a group's (G, T) tensors: its prompt, the shown
    completions' tokens (as many as completion_ids has), each token's probability, covariance
    score and every method's weight and touched flag, and each completion's advantage and
    `scores` (its reward, and its accuracy: 1 when right); rounded to 4 digits."""
    lengths = mask.sum(1).long().tolist()[: len(completion_ids)]
    reward, accuracy = (values[: len(lengths)].tolist() for values in scores)

    def rows(values) -> list[list[float]]:
        return [[float(f"{v:.4g}") for v in row[:n].tolist()] for row, n in zip(values, lengths)]

    return {
        "label": label,
        "prompt": visible(prompt),
        "group_size": len(mask),
        "reward": [round(r, 4) for r in reward],
        "correct": [a == 1 for a in accuracy],
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
    {"label", "tokens" (a list of token strings per completion), "prob", "cov" (per token),
    "adv" (per completion), "weights" and "touched" (method -> per token)}. Token text is model
    output, so it is escaped; the data travels as JSON with "</" escaped."""
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
            score = ""
            if "reward" in view:
                right = "correct" if view["correct"][i] else "wrong"
                score = f"reward {view['reward'][i]:g} ({right}), "
            body.append(
                f'<p class="meta">completion {i + 1}, {score}advantage '
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
        f"{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f'<h1>{html.escape(title)}</h1><p><label>Weights of <select id="method">{options}'
        f'</select></label></p>{legend}{"".join(body)}<script type="application/json" id="data">'
        f"{data}</script><script>{SCRIPT}</script></body></html>\n"
    )
