"""The prompts a run trains on: each question through the model's chat template, served in a
seeded order reshuffled each epoch; the number served so far is all a checkpoint needs to resume
the order where it stopped. cwgrpo.py and evaluate.py template their questions here."""

import functools

import torch

from cwgrpo_utils.models import loading
from cwgrpo_utils.options import cli


def chat_prompt_ids(tokenizer, question: str, system_prompt: str) -> list[int]:
    """A question as the model's chat template writes it, ready for the assistant's answer."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    template = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return template["input_ids"]


class PromptStream:
    """(prompt ids, gold) pairs of a dataset's rows for a run of cfg (its question_column,
    gold_column, system_prompt, max_prompt_length and seed), in a seeded order reshuffled each
    epoch, those over --max-prompt-length skipped and counted; `position`: the prompts served."""

    def __init__(self, dataset, tokenizer, cfg):
        loading.note_template_system_prompt(tokenizer, cfg.system_prompt)  # SmolLM2's: its own
        rows = zip(dataset[cfg.question_column], dataset[cfg.gold_column])
        pairs = [(chat_prompt_ids(tokenizer, str(q), cfg.system_prompt), str(g)) for q, g in rows]
        self.items = [(ids, gold) for ids, gold in pairs if len(ids) <= cfg.max_prompt_length]
        self.skipped = len(pairs) - len(self.items)
        self.seed = cfg.seed
        self.position = 0
        if self.skipped:
            print(f"skipped {self.skipped} prompts longer than --max-prompt-length")
        too_long = f"every prompt is longer than --max-prompt-length {cfg.max_prompt_length}"
        cli.check(bool(self.items), too_long)

    @functools.lru_cache(maxsize=1)  # noqa: B019 - one stream per run, alive as long as the run
    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.items), generator=generator).tolist()

    def next_batch(self, n: int) -> list[tuple[list[int], str]]:
        """The next n (prompt ids, gold) pairs."""
        batch = []
        for _ in range(n):
            epoch, index = divmod(self.position, len(self.items))
            batch.append(self.items[self.order(epoch)[index]])
            self.position += 1
        return batch
