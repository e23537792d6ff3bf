"""System tests of whole runs: kill anywhere, faults, degenerate batches, bad input, resume, the
processes a run owns, and what it leaves (its curves, its token page, its summary)."""

import copy
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from cwgrpo_utils import OPEN_RS_SYSTEM_PROMPT
from cwgrpo_utils.machine.precision import Precision
from cwgrpo_utils.models import loading, tiny
from cwgrpo_utils.models.prompts import PromptStream, chat_prompt_ids
from cwgrpo_utils.options import cli
from cwgrpo_utils.run import checkpoints, token_page
from cwgrpo_utils.run import folder as run_folder
from tests.support import (
    LORA,
    LORA_ARGS,
    PRECISION,
    ROLLOUT,
    ROOT,
    Crash,
    PageParser,
    alive,
    children_of,
    crash_at_save,
    evaluate_as_printed,
    fault_run,
    processes_tagged,
    read_metrics,
    run_cli,
    started_run,
    tensorboard_records,
)


def test_missing_column_lists_the_columns(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(SystemExit, match=r"no column 'problem'.*columns found: question, answer"):
        loading.load_dataset(str(data), "train", "problem", "solution")
    assert loading.load_dataset(str(data), "train", "question", "answer")["answer"] == ["2"]


def test_model_not_found_offline_fails_clearly(tmp_path):
    with pytest.raises(SystemExit, match="cannot load model 'no-such-org/no-such-model'"):
        loading.load_model("no-such-org/no-such-model", torch.float32, torch.device("cpu"))
    with pytest.raises(SystemExit, match="cannot load dataset 'no-such-org/no-such-data'"):
        loading.load_dataset("no-such-org/no-such-data", "train", "problem", "solution")


def test_bad_paths_and_data_stop_before_any_model_is_loaded(tmp_path, tiny_args, monkeypatch):
    def no_loading(*_, **__):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load_model", no_loading)
    monkeypatch.setattr(loading, "load_tokenizer", no_loading)

    def refused(*args):
        with pytest.raises(SystemExit) as error:
            cwgrpo.main(
                *cwgrpo.parse_config([*tiny_args, "--output-dir", str(tmp_path / "r"), *args])
            )
        assert "\n" not in str(error.value)
        return str(error.value)

    (tmp_path / "file").write_text("")
    assert (
        refused("--output-dir", str(tmp_path / "file"))
        == f"error: --output-dir {tmp_path / 'file'} is a file; choose a folder"
    )
    assert "holds no complete checkpoint; drop --resume" in refused("--resume")
    assert (
        refused("--model", str(tmp_path / "no" / "model"))
        == f"error: --model {tmp_path / 'no' / 'model'}: no such folder"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert (
        refused("--dataset", str(empty))
        == f"error: dataset file {empty} is empty; give a file with some rows"
    )
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text('{"problem": "1+1", "solution": null}\n{"problem": " ", "solution": "2"}\n')
    assert refused("--dataset", str(nulls)) == (
        f"error: dataset '{nulls}' has no row with both a problem and a solution; "
        "check --question-column and --gold-column"
    )
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "1+1", "solution": "2"}\n\n{"problem": "2+2", "solution"\n')
    message = refused("--dataset", str(broken))
    assert (
        message.startswith(f"error: {broken} line 3 is not valid JSON") and "online" not in message
    )


def test_empty_rows_are_skipped_and_grading_problems_are_said_once_and_summed(
    tmp_path, tiny_args, capsys
):
    rows = [json.loads(line) for line in (Path(tiny_args[5]).read_text().splitlines()[:32])]
    for i, row in enumerate(rows[:16]):
        row["solution"] = "see the book" if i % 2 else row["solution"]  # no answer to parse
    rows += [{"problem": f"{i}+0", "solution": None} for i in range(32)]  # null in the file
    data = tmp_path / "half.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cli.WARNED.clear()
    args = [*tiny_args, "--dataset", str(data), "--steps", "3", "--save-every", "3"]
    out = cwgrpo.main(*cwgrpo.parse_config([*args, "--output-dir", str(tmp_path / "run")]))
    printed = capsys.readouterr()
    assert "skipped 32 of 64 rows: empty solution\n" in printed.out
    records = read_metrics(out / "metrics.jsonl")
    unparseable = sum(r["gold_unparseable"] for r in records)
    assert unparseable > records[0]["gold_unparseable"] > 0  # on several steps ...
    assert printed.err.count("completions graded against a gold math-verify cannot parse") == 1
    assert (
        f"  grading: {unparseable} completions graded against a gold math-verify cannot parse "
        "(scored 0)\n" in printed.out  # ... said once, then summed at the end
    )


def test_resume_reproduces_the_uninterrupted_run(tiny_run, tmp_path, TINY_RUN, monkeypatch):
    crashed = tmp_path / "crashed"
    crash_at_save(monkeypatch, 2)  # during step 4's save: no checkpoint-4, no final model
    with pytest.raises(Crash):
        cwgrpo.main(*cwgrpo.parse_config([*TINY_RUN, "--output-dir", str(crashed)]))
    monkeypatch.undo()
    assert checkpoints.latest_checkpoint(crashed).name == "checkpoint-2"
    cwgrpo.main(*cwgrpo.parse_config([*TINY_RUN, "--output-dir", str(crashed), "--resume"]))
    assert read_metrics(crashed / "metrics.jsonl") == read_metrics(tiny_run / "metrics.jsonl")


def test_existing_run_is_not_silently_overwritten(tiny_run, TINY_RUN):
    with pytest.raises(SystemExit, match="already holds a run"):
        cwgrpo.main(*cwgrpo.parse_config([*TINY_RUN, "--output-dir", str(tiny_run)]))


def test_grpo_and_token_mean_and_iterations_run(tmp_path, TINY_RUN):
    out = tmp_path / "grpo"
    cwgrpo.main(
        *cwgrpo.parse_config(
            [
                *TINY_RUN,
                "--method",
                "grpo",
                "--output-dir",
                str(out),
                "--steps",
                "2",
                "--loss-aggregation",
                "token-mean",
                "--num-iterations",
                "2",
                "--groups-per-micro-batch",
                "2",
                "--beta",
                "0",
            ]
        )
    )
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and [
        r["rollout_step"] for r in records
    ] == [1, 1, 2, 2]
    # the second update of a batch keeps the rollout's old log-probs: its ratios have moved off 1,
    # so its token-mean loss differs from the first's (on-policy, both would be -mean(A) alike)
    assert records[1]["loss"] != records[0]["loss"] and records[3]["loss"] != records[2]["loss"]
    assert records[0]["lr"] > records[1]["lr"] > 0  # one scheduler step per update


@pytest.mark.parametrize("method", sorted(cwgrpo.METHODS))
def test_every_method_trains_on_the_tiny_preset(method, tmp_path, tiny_args):
    out = tmp_path / method
    cwgrpo.main(
        *cwgrpo.parse_config(
            [
                *tiny_args,
                "--method",
                method,
                "--steps",
                "2",
                "--save-every",
                "2",
                "--output-dir",
                str(out),
            ]
        )
    )
    records = read_metrics(out / "metrics.jsonl")
    passes = cwgrpo.METHODS[method].update_passes
    assert [r["update_pass"] for r in records] == list(range(passes)) * 2  # lopti: low pass first
    assert all(
        math.isfinite(r[k])
        for r in records
        for k in ("loss", "grad_norm", "w_mean", "touched_frac")
    )
    if passes == 2:  # the two passes' active tokens partition the valid tokens
        assert records[0]["pg_active_frac"] + records[1]["pg_active_frac"] == pytest.approx(1.0)
    assert all(METHOD_FOOTPRINT[method](r) for r in records), records


METHOD_FOOTPRINT = {  # what each method must have done to a batch's tokens, from its metrics
    "grpo": lambda r: r["touched_frac"] == 0 and r["w_min"] == r["w_max"] == 1,
    "cw": lambda r: r["touched_frac"] > 0.5 and r["w_min"] < 1 < r["w_max"],
    "clip_cov": lambda r: r["touched_frac"] < 0.05 and r["w_min"] in (0, 1) and r["w_max"] == 1,
    "kl_cov": lambda r: r["touched_frac"] == 0,  # on-policy: |logp - old_logp| is 0
    "ar": lambda r: r["touched_frac"] > 0.5 and 0.8 <= r["w_min"] and r["w_max"] <= 1,
    "lopti": lambda r: 0 < r["pg_active_frac"] < 1 and r["w_min"] == r["w_max"] == 1,
    "ar_lopti": lambda r: 0 < r["pg_active_frac"] < 1 and 0.7 <= r["w_min"] and r["w_max"] <= 1,
    "ict": lambda r: 0.1 <= r["pg_active_frac"] <= 0.4,  # each response's top 10%, rounded up
    "entropy20": lambda r: 0.15 <= r["pg_active_frac"] <= 0.5,  # ties at the 80th percentile
    "stapo": lambda r: r["pg_active_frac"] > 0.9 and r["w_min"] >= 0,
}


def test_live_run_locks_its_folder_and_kill_9_frees_it_and_its_workers(tmp_path, tiny_args):
    out = tmp_path / "run"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = started_run(*tiny_args, "--reward-workers", "2", out=out, **quiet)
    try:
        workers = children_of(first.pid)
        assert len(workers) >= 2
        second = run_cli(*tiny_args, "--output-dir", str(out), "--resume")
        assert second.returncode != 0 and "Traceback" not in second.stderr
        assert second.stderr.strip().splitlines() == [
            f"error: {out} is in use by a live run (pid {first.pid}); wait for it or stop it, or "
            f"choose another --output-dir"
        ]
    finally:
        first.kill()
        first.wait()
    deadline = time.time() + 60  # a hang guard: they die within a second (grading_pool.py)
    while any(alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(w) for w in workers)  # the grading workers died with their parent
    shutil.rmtree(out / "checkpoint-50", ignore_errors=True)
    (out / "metrics.jsonl").write_text("")
    resumed = run_cli(
        *tiny_args, "--output-dir", str(out), "--overwrite-output-dir", "--steps", "1"
    )
    assert resumed.returncode == 0, resumed.stderr  # the dead run's lock does not block


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_stop_signal_checkpoints_the_step_and_prints_the_resume_command(
    tmp_path, tiny_args, stop
):
    out = tmp_path / "run"
    run = started_run(
        *tiny_args, out=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        run.send_signal(stop)  # Ctrl-C, or what timeout, a scheduler or a container stop sends
        _, stderr = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode != 0 and "Traceback" not in stderr
    steps = len((out / "metrics.jsonl").read_text().splitlines())
    assert (out / f"checkpoint-{steps}" / "trainer_state.pt").is_file()
    assert (
        f"stopped after step {steps} (saved checkpoint-{steps}); resume with: python cwgrpo.py"
        in stderr
        and stderr.rstrip().endswith("--resume")
    )


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_second_stop_signal_interrupts_at_once(first, capsys):
    with run_folder.StopRequest() as stop:
        os.kill(os.getpid(), first)
        time.sleep(0.1)  # the handler runs at the next bytecode after delivery
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the default is back
    name = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[first]
    assert f"{name}: stopping after this step, with a checkpoint" in capsys.readouterr().err


def test_a_run_interrupted_mid_step_says_how_to_go_on(tmp_path, monkeypatch, tiny_run):
    """With a checkpoint, the command that resumes from it; before the first, the one that starts
    afresh (--resume would be refused: there is nothing to resume)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "cwgrpo.py"), "--preset", "tiny"])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)  # as python cwgrpo.py
    monkeypatch.chdir(tmp_path)  # elsewhere: the command names the script by its full path
    command = f"python {ROOT / 'cwgrpo.py'} --preset tiny"
    lost = "interrupted: the step under way is lost; "
    for folder, go_on in (
        (tmp_path / "run", f"no checkpoint was written yet; start afresh with: {command} "
         "--overwrite-output-dir"),
        (tiny_run, f"{tiny_run / 'checkpoint-4'} is intact; resume with: {command} --resume"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            with run_folder.RunFolder(folder, {}, False, False, ()):
                raise KeyboardInterrupt  # what a second Ctrl-C or SIGTERM raises
        assert str(stop.value) == lost + go_on


def test_a_run_leaves_its_curves_and_a_valid_small_token_page(tiny_run):
    assert (tiny_run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tiny_run / "tokens.html").read_text()
    assert "cw as released normalises its weights over padded positions" in page  # the legend
    views = run_folder.read_records(tiny_run / "tokens.jsonl")
    assert [v["label"] for v in views] == ["step 1", "step 4"]
    assert len(page.encode()) < 300_000
    parser = PageParser()
    parser.feed(page)
    parser.close()
    assert parser.stack == []
    for index, view in enumerate(views):  # every token's text, once per view, in order
        assert parser.views[index] == [token for tokens in view["tokens"] for token in tokens]
        assert list(view["weights"]) == [
            shown for shown, *_ in token_page.shown_passes(cwgrpo.METHODS)
        ]
    embedded = page.split('<script type="application/json" id="data">')[1].split("</script>")[0]
    assert json.loads(embedded)["views"][0]["weights"] == views[0]["weights"]


def test_token_page_escapes_model_output(tmp_path):
    hostile = ["</script><script>alert(1)</script>", "<b>", "&amp;", '"q"']
    view = {
        "label": "step 1",
        "prompt": "<b>question</b></div>",
        "group_size": 2,
        "reward": [1.0],
        "correct": [True],
        "tokens": [hostile],
        "prob": [[0.5] * 4],
        "score": [[0.0] * 4],
        "adv": [1.0],
        "weights": {"grpo": [[1.0] * 4]},
        "touched": {"grpo": [[0] * 4]},
    }
    token_page.write(tmp_path / "t.html", "t", "grpo", {"grpo": "GRPO"}, [view])
    page = (tmp_path / "t.html").read_text()
    assert "<b>" not in page and "alert(1)</script>" not in page
    parser = PageParser()
    parser.feed(page)
    assert parser.views[0] == hostile and parser.stack == []


def test_token_view_shows_the_prompt_scores_and_the_methods_weights(tiny_base, tmp_path):
    cfg, run_cfg = cwgrpo.parse_config(["--preset", "tiny", "--max-completion-length", "12"])
    model = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    torch.manual_seed(0)
    prompt = chat_prompt_ids(tokenizer, "3+4", "")
    samples = cwgrpo.sample(model, tokenizer, [prompt], cfg, cwgrpo.Passes.of(cfg, run_cfg))
    grades = [cwgrpo.grade_accuracy(text, "\\boxed{7}") for text in samples.texts]
    rewards = cwgrpo.rewards_of(samples.texts, grades, cfg)
    advantages = torch.randn(cfg.group_size, generator=torch.Generator().manual_seed(1))
    rollout = cwgrpo.Batch.of(samples, rewards, advantages, old=None, ref_logp=None)
    run = types.SimpleNamespace(path=tmp_path, resumed_step=0)  # a fresh run's folder
    passes = cwgrpo.Passes.of(cfg, run_cfg)
    weigh = cwgrpo.every_methods_weights
    page = token_page.TokenPage(run, cfg, tokenizer, cwgrpo.METHODS, weigh, passes)
    rng = torch.get_rng_state()
    fp32 = Precision.choose("auto", torch.device("cpu"))
    page(1, model=model, batch=rollout, autocast=fp32.autocast)
    assert torch.equal(torch.get_rng_state(), rng)  # clip_cov's draws leave training unchanged
    (view,) = run_folder.read_records(tmp_path / "tokens.jsonl")
    assert view["prompt"] == "<|im_start|>user\n3+4<|im_end|>\n<|im_start|>assistant\n"
    assert view["group_size"] == cfg.group_size == 8 and len(view["tokens"]) == 4
    assert view["reward"] == pytest.approx(rollout.rewards[:4].tolist(), abs=1e-4)
    assert view["correct"] == [g.accuracy == 1 for g in grades[:4]]
    page = (tmp_path / "tokens.html").read_text()
    assert "4 of the group's 8 completions" in page and "3+4" in page
    for i, right in enumerate(view["correct"]):
        verdict = "correct" if right else "wrong"
        assert f"completion {i + 1}, reward {view['reward'][i]:g} ({verdict})" in page
    with torch.no_grad():
        logp, _, _ = cwgrpo.completion_logprobs(model, rollout, cfg, passes)
    mask = rollout.completion_mask
    cw = cwgrpo.cw_weights(logp, rollout.advantages, mask)
    for i, tokens in enumerate(view["tokens"]):
        n = int(mask[i].sum())
        assert tokens == token_page.token_texts(tokenizer, rollout.completion_ids[i, :n].tolist())
        assert view["weights"]["cw"][i] == pytest.approx(cw[i, :n].tolist(), rel=1e-3)
        assert view["weights"]["grpo"][i] == [1.0] * n
        assert view["prob"][i] == pytest.approx(logp[i, :n].exp().tolist(), rel=1e-3)


def test_a_run_says_what_it_does_and_what_it_did(tiny_args, tmp_path):
    out = run_cli(*tiny_args, "--steps", "2", "--output-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"cwgrpo: --method cw on {tiny_args[3]}, data {tiny_args[5]}"
    assert lines[1].startswith("  8 prompts x G = 8 per step, 2 steps, beta 0.04")
    summary = lines[lines.index(next(x for x in lines if x.startswith("done in "))) :]
    assert [x.split()[0] for x in summary[1:6]] == ["reward", "accuracy", "format", "entropy", "kl"]
    evaluate = f"python evaluate.py --model {tmp_path / 'run' / 'final-model'}"
    assert summary[-2].startswith(f"evaluate it: {evaluate} ")
    assert summary[-2].endswith(" (samples at the paper's evaluation temperature, 0.6)")
    assert summary[-1].startswith(f"  or at its training temperature, 1: {evaluate} ")
    assert summary[-1].endswith(" --temperature 1")


def test_import_cwgrpo_loads_no_plotting_library():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, cwgrpo; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_the_paper_recipe_code_path_runs_and_resumes_on_cpu(tmp_path, tiny_base, monkeypatch):
    """The paper-1.5b preset's code path, which no tiny run takes: an untied LM head, gradient
    checkpointing, the Open-RS system prompt through the chat template, beta 0.04 with a
    reference model, then a checkpoint and --resume. Qwen2.5-1.5B's hidden size (1,536), heads
    (12) and KV heads (2) and its untied head, in 2 layers. Reduced where CPU time forces it:
    the MLP width (8,960 -> 1,536), the vocabulary (151,936 -> the byte-level tokenizer's),
    prompt lengths (byte tokens are about four times Qwen's: --max-prompt-length 1024), and 16
    new tokens (--length-limit new)."""
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=1536,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    checkpoints.save_checkpoint(tmp_path, "qwen-1.5b-shaped", model, tokenizer)
    args = [
        "--preset",
        "paper-1.5b",
        "--device",
        "cpu",
        "--model",
        str(tmp_path / "qwen-1.5b-shaped"),
        "--dataset",
        str(tiny_base / "arithmetic.jsonl"),
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-prompt-length",
        "1024",
        "--length-limit",
        "new",
        "--max-completion-length",
        "16",
        "--steps",
        "2",
        "--save-every",
        "1",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    cfg, run_cfg = cwgrpo.parse_config(args)
    full = tmp_path / "full"
    cwgrpo.main(*cwgrpo.parse_config([*args, "--output-dir", str(full)]))
    crash_at_save(monkeypatch, 2)  # a crash during checkpoint-2's save, then --resume
    assert (run_cfg.gradient_checkpointing, cfg.beta, cfg.method, cfg.system_prompt) == (
        True,
        0.04,
        "cw",
        OPEN_RS_SYSTEM_PROMPT,
    )
    with pytest.raises(Crash):
        cwgrpo.main(cfg, run_cfg)
    monkeypatch.undo()
    records = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    # a random model earns no reward, so its advantages and update are 0; what is checked is that
    # the whole path runs: the reference pass, backward through checkpointed layers, the untied head
    assert all(math.isfinite(r[k]) for r in records for k in ("loss", "grad_norm", "kl_mean"))
    cwgrpo.main(*cwgrpo.parse_config([*args, "--resume"]))
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == records


# ------------------------------------------------------------- whole runs: kill anywhere, faults
# A tiny run is killed (SIGKILL) at the Nth call of a named function (faults.py), then resumed;
# the resumed run must finish with one record per step, equal bit for bit to an uninterrupted run
# (all keys but timings), and no grading worker may outlive the kill.
FAULT_STEPS = ["--steps", "6", "--save-every", "2", "--threads", "1", "--reward-workers", "1"]


VLLM_SAMPLER = "cwgrpo_utils.machine.vllm_engine:Engine.generate"
SAMPLER = "cwgrpo:sample_tokens" if ROLLOUT == "hf" else VLLM_SAMPLER


KILL_POINTS = {  # CWGRPO_FAULT -> where the run dies
    f"{SAMPLER}:3": "sampling step 3",
    "cwgrpo_utils.machine.grading_pool:Grader.submit:3:after": "grading step 3, workers busy",
    "cwgrpo:token_stats:4": "step 3's reference pass (calls: ref 1, page 1, ref 2, ref 3)",
    "torch.nn.utils:clip_grad_norm_:3:after": "step 3's update, after backward, before the step",
    "torch.optim:AdamW.step:5:after": "step 5's update, after the optimizer step",
    "cwgrpo_utils.run.folder:append_record:3:torn": "writing step 3's metrics (half a line)",
    "transformers:PreTrainedModel.save_pretrained:2:after": "checkpoint-4: weights written",
    "transformers:PreTrainedTokenizerBase.save_pretrained:2:after": "checkpoint-4: tokenizer",
    "torch:save:3:after": "checkpoint-4: optimizer.pt written, trainer_state.pt not",
    "torch:save:4:after": "checkpoint-4: trainer state written, not yet renamed",
    "cwgrpo_utils.run.checkpoints:prune_checkpoints:2": "checkpoint-4 renamed, 2 has optimizer",
    "cwgrpo_utils.run.plots:plot_run:1": "just after checkpoint-2 is complete, before its pictures",
    "cwgrpo_utils.run.token_page:write:2": "drawing the last step's token page, before its update",
    "cwgrpo_utils.run.checkpoints:save_checkpoint:4": "after every step, before final-model",
}


# With --rollout vllm (CI's vLLM venv, whose share of CI's 25 minutes is bounded): the kill points
# where the engine's state matters (inside its sampling call, where the resumed run equals the
# uninterrupted one only if the new engine, built with random weights, is given checkpoint-2's;
# with grading in flight; after a step whose weights the engine does not have yet; just after a
# checkpoint); those inside a checkpoint's writing are the sampler's business no more than the HF
# loop's, and run there
VLLM_KILL_POINTS = (
    VLLM_SAMPLER,
    "cwgrpo_utils.machine.grading_pool:Grader",
    "torch.optim:",
    "cwgrpo_utils.run.plots:plot_run",
)


if ROLLOUT == "vllm":
    KILL_POINTS = {f: where for f, where in KILL_POINTS.items() if f.startswith(VLLM_KILL_POINTS)}
if LORA:  # a LoRA checkpoint's weights are the adapter's, which PEFT writes
    weights = "transformers:PreTrainedModel.save_pretrained:2:after"
    KILL_POINTS["peft:PeftModel.save_pretrained:2:after"] = KILL_POINTS.pop(weights)
if LORA == "ci":  # CI's budget: where the adapter's state matters (all 14
    # passed on the CPU with LoRA): its save, its update, the reference pass with it off, a step
    lora_points = ("peft:", "torch.optim:", "cwgrpo:token_stats", SAMPLER)
    KILL_POINTS = {f: where for f, where in KILL_POINTS.items() if f.startswith(lora_points)}


def kill_and_resume(fault: str, out: Path, tiny_args) -> dict:
    args = [*tiny_args, *FAULT_STEPS, "--output-dir", str(out)]
    marker = f"{out}-{time.time()}"
    killed = fault_run(args, fault, marker)
    deadline = time.time() + 60  # workers die within a second of their parent (grading_pool.py)
    while processes_tagged(marker) and time.time() < deadline:
        time.sleep(0.1)
    survivors = processes_tagged(marker)
    resumed = fault_run([*args, "--resume"] if (out / "metrics.jsonl").exists() else args)
    return {"killed": killed, "survivors": survivors, "resumed": resumed}


@pytest.fixture(scope="module")
def uninterrupted_fault_run(tiny_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = fault_run([*tiny_args, *FAULT_STEPS, "--output-dir", str(out)])
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def killed_runs(tiny_args, tmp_path_factory, uninterrupted_fault_run):
    """Every kill point, two at a time (one per core)."""
    root = tmp_path_factory.mktemp("killed")
    with ThreadPoolExecutor(2) as pool:
        jobs = {
            fault: pool.submit(kill_and_resume, fault, root / f"run{i}", tiny_args)
            for i, fault in enumerate(KILL_POINTS)
        }
        return {
            fault: (job.result(), root / f"run{i}") for i, (fault, job) in enumerate(jobs.items())
        }


@pytest.mark.parametrize("fault", list(KILL_POINTS))
def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_run(
    fault, killed_runs, uninterrupted_fault_run
):
    result, out = killed_runs[fault]
    assert result["killed"].returncode == -signal.SIGKILL, result["killed"].stderr[-2000:]
    assert result["survivors"] == [], "grading workers outlived the kill"
    assert result["resumed"].returncode == 0, result["resumed"].stderr[-2000:]
    resumed, expected = (
        read_metrics(out / "metrics.jsonl"),
        read_metrics(uninterrupted_fault_run / "metrics.jsonl"),
    )
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # exactly one record per step
    assert resumed == expected  # bit for bit, all keys but timings
    if LORA:  # and TensorBoard holds each step once, the numbers of metrics.jsonl
        numbers = [{k: v for k, v in r.items() if isinstance(v, int | float)} for r in resumed]
        logged = tensorboard_records(out)
        assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
        for back, record in zip(logged, numbers):
            assert back == pytest.approx(record, rel=1e-6)  # float32 in the event files
    assert (out / "final-model" / "config.json").is_file()
    assert (out / "tokens.html").is_file() and (out / "curves.png").is_file()
    assert not list(out.glob(".*.partial"))


def test_a_failed_save_keeps_the_previous_checkpoint_stops_in_one_line_and_resumes(
    tiny_args, tmp_path, uninterrupted_fault_run
):
    out = tmp_path / "run"
    args = [*tiny_args, *FAULT_STEPS, "--output-dir", str(out)]
    full = fault_run(args, "torch:save:3:enospc")  # checkpoint-4's optimizer.pt: disk full
    assert full.returncode == 1
    assert full.stderr.strip().splitlines()[-1] == (
        f"error: could not write {out / 'checkpoint-4'} (No space left on device); "
        f"{out / 'checkpoint-2'} is intact; free space and resume with: python cwgrpo.py "
        f"{shlex.join(args)} --resume"
    )
    assert "Traceback" not in full.stderr
    assert not (out / ".checkpoint-4.partial").exists() and not (out / "checkpoint-4").exists()
    assert (out / "checkpoint-2" / "trainer_state.pt").is_file()
    resumed = fault_run([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert read_metrics(out / "metrics.jsonl") == read_metrics(
        uninterrupted_fault_run / "metrics.jsonl"
    )


def test_a_save_the_disk_cannot_hold_stops_before_writing(tiny_args, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(
        checkpoints.shutil,
        "disk_usage",
        lambda p: real(p)._replace(free=1_000),  # < any checkpoint, a LoRA adapter's too
    )
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as error:
        cwgrpo.main(
            *cwgrpo.parse_config(
                [*tiny_args, "--steps", "2", "--save-every", "2", "--output-dir", str(out)]
            )
        )
    message = str(error.value)
    assert (
        message.startswith(f"error: {out / 'checkpoint-2'} needs about 0.00")
        and "\n" not in message
    )
    start_afresh = (
        "0.00 GB are free; no checkpoint was written yet; free space and start afresh with"
    )
    assert start_afresh in message and message.endswith(" --overwrite-output-dir")
    assert not (out / ".checkpoint-2.partial").exists()


def test_drawing_that_fails_warns_once_and_the_run_trains_on(tiny_args, tmp_path):
    out = tmp_path / "run"
    (out / "curves.png").mkdir(parents=True)  # savefig cannot write a folder
    done = run_cli(*tiny_args, "--steps", "4", "--save-every", "1", "--output-dir", str(out))
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: could not draw curves.png (")
    assert [int(p.name.split("-")[1]) for p in sorted(out.glob("checkpoint-*"))] == [1, 2, 3, 4]
    assert (out / "tokens.html").is_file()  # the other picture is still drawn
    assert len(read_metrics(out / "metrics.jsonl")) == 4


def single_valid_token(sample):
    """The real sampler, with every token of the first group but its first one masked out."""

    def wrapped(model, tokenizer, prompts, cfg, **options):
        samples = sample(model, tokenizer, prompts, cfg, **options)
        samples.completion_mask[: cfg.group_size] = 0
        samples.completion_mask[0, 0] = 1
        return samples

    return wrapped


def prompt_length(tiny_base) -> int:
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    return len(chat_prompt_ids(tokenizer, "1+2", ""))  # every tiny question is a+b


DEGENERATE = ["all-masked", "equal-rewards", "eos-at-once", "one-valid-token", "prompt-at-limit"]
if ROLLOUT == "vllm":  # the batches the sampler makes: rewards and a monkeypatched sample are not
    DEGENERATE = ["all-masked", "eos-at-once", "prompt-at-limit"]


@pytest.mark.parametrize("case", DEGENERATE)
def test_every_method_trains_on_a_degenerate_batch_with_the_pictures_on(
    case, tiny_args, tiny_base, eos_first_model, tmp_path, monkeypatch
):
    small = [
        "--steps",
        "2",
        "--save-every",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--groups-per-micro-batch",
        "2",
        "--reward-workers",
        "1",
    ]
    extra = {
        "all-masked": ["--mask-truncated-completions", "--max-completion-length", "2"],
        "equal-rewards": ["--accuracy-weight", "0", "--format-weight", "0"],
        "eos-at-once": ["--model", str(eos_first_model)],
        "one-valid-token": [],
        "prompt-at-limit": [
            "--max-prompt-length",
            str(prompt_length(tiny_base)),
            "--length-limit",
            "total",
            "--max-completion-length",
            str(prompt_length(tiny_base) + 1),
        ],
    }[case]
    if case == "one-valid-token":
        monkeypatch.setattr(cwgrpo, "sample", single_valid_token(cwgrpo.sample))
    # with --rollout vllm or CI's LoRA one method of one pass and one of two (lopti): the methods'
    # math is the sampler's business no more than the HF loop's, and LoRA's reference pass (the
    # adapter off) is every method's alike; CWGRPO_TEST_LORA=1 runs every method
    methods = cwgrpo.METHODS if ROLLOUT == "hf" and LORA != "ci" else ("grpo", "lopti")
    for method in methods:
        out = tmp_path / method
        cwgrpo.main(
            *cwgrpo.parse_config(
                [*tiny_args, *small, *extra, "--method", method, "--output-dir", str(out)]
            )
        )
        records = read_metrics(out / "metrics.jsonl")
        assert len(records) == 2 * cwgrpo.METHODS[method].update_passes, method
        for record in records:
            numbers = {k: v for k, v in record.items() if isinstance(v, float)}
            assert all(math.isfinite(v) for v in numbers.values()), (method, record)
        assert (out / "final-model" / "config.json").is_file() and (out / "tokens.html").is_file()
        if case == "all-masked":
            assert all(r["truncated_frac"] == 1 and r["grad_norm"] == 0 for r in records), method
        if case == "equal-rewards":  # no advantage: only the KL term, 0 where policy = reference
            assert all(r["reward_std"] == 0 for r in records), method
            if PRECISION != "fp16":
                assert all(r["grad_norm"] == 0 for r in records), method
            else:  # the reference is held in fp16, the policy's master weights in fp32: the KL
                # term sees the rounding between them (5.9e-5 at step 1, every method below
                # 6.4e-3 at step 2); a run's gradient norm is about 0.5
                assert all(r["grad_norm"] < 0.05 for r in records), method
        if case == "eos-at-once":
            assert all(r["completion_len_mean"] == 1 for r in records), method
        if case == "prompt-at-limit":
            assert all(r["prompts_skipped"] == 0 and r["completion_len_mean"] == 1 for r in records)


# ----------------------------------------------------- silent or misleading, as a user meets it
def test_a_resume_with_other_options_is_refused_and_the_record_kept(tiny_args, tmp_path):
    out = tmp_path / "run"
    first = fault_run(
        [
            *tiny_args,
            "--method",
            "cw",
            "--steps",
            "4",
            "--save-every",
            "2",
            "--output-dir",
            str(out),
        ],
        "cwgrpo_utils.run.checkpoints:save_checkpoint:2",
    )  # before ckpt-4
    assert first.returncode == -signal.SIGKILL, first.stderr
    record = (out / "run_config.json").read_text()

    def resume(method: str, steps: int):
        options = ["--method", method, "--steps", str(steps), "--save-every", "2"]
        return run_cli(*tiny_args, *options, "--output-dir", str(out), "--resume")

    refused = resume("grpo", 4)
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert line.startswith(
        f"error: --resume with options other than {out / 'checkpoint-2'}'s: "
        "--method 'cw' -> 'grpo'; resume with the run's own options"
    )
    assert "--steps, --save_every, --log_every, --reward_workers, --output_dir" in line
    assert "\n" not in line and (out / "run_config.json").read_text() == record
    extended = resume("cw", 5)
    assert extended.returncode == 0, extended.stderr
    assert (
        "note: --steps 5 (was 4): the cosine learning-rate schedule is recomputed"
        in extended.stdout
    )
    recorded = json.loads((out / "run_config.json").read_text())
    assert recorded["method"] == "cw" and recorded["steps"] == 4  # the run as it was started
    assert recorded["resumes"] == [{"from": "checkpoint-2", "changed": {"steps": [4, 5]}}]
    again = resume("cw", 5)
    assert again.returncode == 0
    assert f"nothing to do: {out} has finished its 5 steps" in again.stdout
    assert "done in" not in again.stdout  # no retraining, no summary


def test_a_resume_may_change_the_threads_says_so_and_its_summary_says_what_it_counts(
    tiny_args, tmp_path
):
    """Threads say how a run computes, not what: a resume may change them, in one line that says
    what that may do to its records; its closing time is this part's, beside the whole run's."""
    out = tmp_path / "run"
    options = [*tiny_args, "--save-every", "2", "--output-dir", str(out)]
    first = run_cli(*options, "--steps", "2")
    assert first.returncode == 0, first.stderr
    assert "threads: 1 (" in first.stdout  # a tiny model's, or OMP_NUM_THREADS's (CI's)
    resumed = run_cli(*options, "--steps", "4", "--threads", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "threads: 2 (--threads 2)" in resumed.stdout
    assert (
        "note: resumed with torch threads 2 (was 1): that changes how the run computes, not what, "
        "so its records may differ from an uninterrupted run's in the last bits" in resumed.stdout
    )
    records = run_folder.read_records(out / "metrics.jsonl")  # with their timings
    steps_s = sum({r["rollout_step"]: r["rollout_s"] for r in records}.values())
    steps_s += sum(r["update_s"] for r in records)
    done = next(line for line in resumed.stdout.splitlines() if line.startswith("done in "))
    assert f"(this part, resumed from checkpoint-2; the whole run's steps {steps_s:.0f} s)" in done


@pytest.mark.parametrize(
    "argv",
    [
        [str(ROOT / "evaluate.py"), "--model", "runs/nope"],
        ["-m", "tools.diagnose", "batch", "--preset", "tiny", "--model", "runs/nope"],
    ],
)
def test_a_missing_local_model_is_one_line_at_once_and_leaves_no_folder(argv, tmp_path):
    (tmp_path / "runs").mkdir()
    done = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # the tools run as modules of the repository
    )
    assert done.stderr.strip() == "error: --model runs/nope: no such folder"
    assert not (tmp_path / "eval").exists()


def test_an_unreachable_hub_fails_fast_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "cwgrpo.py"),
            "--method",
            "cw",
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard
        env=env,
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "the hub cannot be reached from here, so only what is cached loads" in done.stderr
    assert not (tmp_path / "run").exists()  # a run that failed early leaves no folder


def test_the_tiny_preset_works_from_any_folder_builds_once_and_is_quiet(tmp_path):
    clone, elsewhere = tmp_path / "clone", tmp_path / "elsewhere"
    for part in (
        "cwgrpo.py",
        "evaluate.py",
        "cwgrpo_utils",
        "evaluation_sets/tiny-arithmetic.jsonl",
    ):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        (clone / part).parent.mkdir(parents=True, exist_ok=True)
        copy(ROOT / part, clone / part)
    elsewhere.mkdir()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    args = ["--preset", "tiny", "--steps", "12", "--save-every", "12"]
    command = [sys.executable, str(clone / "cwgrpo.py"), *args]  # a hang guard, 10x a quiet run
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=1800, env=env, cwd=elsewhere
    )
    assert done.returncode == 0, done.stderr
    base = clone / "runs" / "tiny-base"
    assert done.stdout.count(f"building the tiny preset's model and data in {base}") == 1
    assert (base / "model" / "config.json").is_file() and not (
        elsewhere / "runs" / "tiny-base"
    ).exists()
    output = done.stdout + done.stderr
    for noise in ("past_key_values", "Generating train split", "Writing model shards", "it/s]"):
        assert noise not in output
    progress = [line for line in done.stdout.splitlines() if line.startswith("cw: step")]
    assert progress == ["cw: step 10/12, " + progress[0].split(", ", 1)[1], progress[1]]
    assert progress[1].startswith("cw: step 12/12, reward ")
    # the evaluate command it prints works from the same folder, as printed (a few problems)
    printed = f"evaluate it: python {clone / 'evaluate.py'} --model runs/cw-tiny-seed0/"
    assert printed in done.stdout
    evaluated = evaluate_as_printed(done.stdout, "--limit", "4", "--n", "2", cwd=elsewhere, env=env)
    assert evaluated.returncode == 0, evaluated.stderr
    again = subprocess.run(
        command, capture_output=True, text=True, timeout=1800, env=env, cwd=tmp_path
    )
    assert again.returncode == 0 and "building" not in again.stdout  # once per clone


def test_lopti_shows_both_passes_on_the_token_page():
    passes = token_page.shown_passes(cwgrpo.METHODS)
    names = [shown for shown, *_ in passes]
    assert names.count("lopti") == 1 and "lopti, pass 2" in names and "ar_lopti, pass 2" in names
    about = {shown: text for shown, *_, text in passes}
    assert about["lopti, pass 2"] == "lopti's pass 2, on the tokens pass 1 left out"


def test_split_byte_tokens_show_their_character_once_complete():
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    ids = tokenizer("é=1", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4  # é is two bytes, so two byte tokens
    assert token_page.token_texts(tokenizer, ids + [tokenizer.eos_token_id]) == [
        "\u00b7",
        "é",
        "=",
        "1",
        "<|im_end|>",
    ]


def test_control_bytes_show_as_escapes_on_the_token_page():
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    ids = tokenizer("a\x00\x15\n\tb\x7f", add_special_tokens=False)["input_ids"]
    texts = token_page.token_texts(tokenizer, ids)
    assert texts == ["a", "\\x00", "\\x15", "\n", "\t", "b", "\\x7f"]
    assert token_page.visible("q\x85\u2028") == "q\\x85\u2028"  # C1 too; a separator is not Cc


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"rollout_step": 1}\n{"rollout_step": 2}\n{"rollout_st')
    run_folder.keep_records_until(path, 5)
    assert path.read_text() == '{"rollout_step": 1}\n{"rollout_step": 2}\n'


def test_rng_states_hold_only_the_runs_own_gpu(monkeypatch):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7]))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: restored.append(state))
    states = checkpoints.rng_states()
    assert torch.equal(states["cuda"], torch.tensor([7]))
    checkpoints.set_rng_states(states)
    checkpoints.set_rng_states(states | {"cuda": [torch.tensor([5]), torch.tensor([6])]})  # older
    assert [int(s) for s in restored] == [7, 5]


# ----------------------------------------- nothing corrupt gets in: NaN, foreign pickles, memory
def finite_weights(folder: Path) -> bool:
    tensors = safetensors.torch.load_file(next(folder.glob("*.safetensors")))
    return all(torch.isfinite(t).all() for t in tensors.values())


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_nan_in_one_micro_batch_is_skipped_and_counted_and_the_run_goes_on(
    precision, tiny_args, tmp_path
):
    out = tmp_path / "run"
    args = [*tiny_args, *FAULT_STEPS, "--precision", precision, "--output-dir", str(out)]
    # the log-prob pass (the fast drop-in) of step 2's update; 1: step 1's reference, 2: its page
    done = fault_run(args, "cwgrpo:completion_logprobs:5:nan")
    assert done.returncode == 0, done.stderr[-2000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 1, 1, 1]
    assert math.isnan(records[1]["loss"]) and math.isnan(records[1]["grad_norm"])
    assert records[2]["lr"] == records[1]["lr"]  # the schedule did not move either
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 1)
    if precision == "fp16":  # the loss scaler saw the overflow too, and halved its scale
        assert [r["loss_scale"] for r in records[:2]] == [65536.0, 32768.0]
    if (
        ROLLOUT == "vllm"
    ):  # the engine samples the trainer's weights, which the skip left as they were
        assert all(r["sampler_logp_diff_max"] < 1e-3 for r in records[2:])
    assert "  skipped: 1 of 6 optimizer steps, their gradient not finite" in done.stdout
    assert ", skipped 1" in done.stdout  # the progress line
    assert finite_weights(out / "final-model")


def test_a_nan_at_every_step_stops_the_run_in_one_line_with_finite_checkpoints(tiny_args, tmp_path):
    out = tmp_path / "run"
    steps = ["--steps", "8", "--save-every", "1", "--threads", "1", "--reward-workers", "1"]
    args = [*tiny_args, *steps, "--max-skipped-steps", "3", "--output-dir", str(out)]
    # every log-prob pass from step 1's update on
    done = fault_run(args, "cwgrpo:completion_logprobs:3+:nan")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: 3 optimizer steps in a row had a non-finite gradient (the last, step 3: loss nan, "
        "grad norm nan) and changed nothing, so the run stops (--max-skipped-steps 3); the newest "
        f"checkpoint, {out / 'checkpoint-2'}, resumes with: python cwgrpo.py "
    )
    assert [r["skipped_steps"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    saved = sorted(out.glob("checkpoint-*"))
    assert len(saved) == 2 and all(finite_weights(folder) for folder in saved)  # 3: stopped first
    assert not (out / "final-model").exists()


OUT_OF_MEMORY = {  # CWGRPO_FAULT -> the phase named, and the flag the resume command takes
    f"{SAMPLER}:3:oom": ("sampling", "--rollout-chunk 4"),
    "cwgrpo:token_stats:4:oom": ("the log-prob passes", "--groups-per-micro-batch 1"),
    "cwgrpo:policy_loss:3:oom": ("the update", "--gradient-checkpointing"),
    "torch.optim:AdamW.step:3:oom": ("the optimizer step", ""),
}
if ROLLOUT == "vllm":  # the engine's phase; the others are the HF loop's, tested there
    OUT_OF_MEMORY = {f"{SAMPLER}:3:oom": ("sampling", "--vllm-gpu-memory-utilization 0.2")}


def test_out_of_memory_before_the_first_checkpoint_prints_the_command_that_starts_afresh(
    tiny_args, tmp_path
):
    """--resume would find no checkpoint and be refused: the line gives the command that works,
    with the flag that lowers the phase, and it runs."""
    out = tmp_path / "run"
    args = [*tiny_args, "--steps", "2", "--save-every", "2", "--output-dir", str(out)]
    done = fault_run([*args, "--reward-workers", "1"], f"{SAMPLER}:1:oom")  # step 1's sampling
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert "; no checkpoint was written yet; start afresh with: python cwgrpo.py " in line
    command = line.split("start afresh with: ")[1]
    flag = OUT_OF_MEMORY[f"{SAMPLER}:3:oom"][1]  # the sampling phase's lever
    assert command.endswith(f"--overwrite-output-dir {flag}") and "--resume" not in command
    again = subprocess.run(
        [sys.executable, *shlex.split(command)[1:]], capture_output=True, text=True, timeout=600,
        cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(read_metrics(out / "metrics.jsonl")) == 2


@pytest.mark.parametrize("fault", list(OUT_OF_MEMORY))
def test_out_of_memory_ends_in_one_line_and_the_resume_reproduces_the_run(
    fault, tiny_args, tmp_path, uninterrupted_fault_run
):
    out = tmp_path / "run"
    args = [*tiny_args, *FAULT_STEPS, "--output-dir", str(out)]
    done = fault_run(args, fault)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    phase, flag = OUT_OF_MEMORY[fault]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"error: out of GPU memory in {phase} at step 3 (the plan's peak there: "
    )
    assert f"{out / 'checkpoint-2'} is intact; resume with: python cwgrpo.py " in line
    assert line.endswith(f"--resume {flag}".rstrip())
    resumed = fault_run([*args, "--resume"])  # the same options, as after a kill
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = read_metrics(uninterrupted_fault_run / "metrics.jsonl")
    assert read_metrics(out / "metrics.jsonl") == expected


@pytest.mark.parametrize("name", ["trainer_state.pt", "optimizer.pt"])
def test_a_poisoned_checkpoint_runs_nothing_in_resume_evaluate_or_the_tools(
    name, tiny_run, tiny_args, tmp_path
):
    out, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(tiny_run, out)
    shutil.rmtree(out / "checkpoint-4")  # checkpoint-2, the newest, keeps its optimizer.pt again
    shutil.copy(tiny_run / "checkpoint-4" / "optimizer.pt", out / "checkpoint-2" / "optimizer.pt")
    torch.save({"rng": Poison(marker)}, out / "checkpoint-2" / name)
    resumed = run_cli(
        *tiny_args, "--steps", "4", "--save-every", "2", "--output-dir", str(out), "--resume"
    )
    assert resumed.returncode == 1 and "Traceback" not in resumed.stderr
    assert resumed.stderr.strip().startswith(
        f"error: {out / 'checkpoint-2' / name} holds a pickled posix.system, not only tensors"
    )
    evaluated = subprocess.run(
        [sys.executable, str(ROOT / "evaluate.py"), "--model", str(out / "checkpoint-2"),
         "--benchmarks", str(ROOT / "evaluation_sets" / "tiny-arithmetic.jsonl"), "--limit", "2",
         "--n", "1", "--max-new-tokens", "4", "--gold-format", "expr",
         "--output-dir", str(tmp_path / "eval")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    diagnosed = subprocess.run(
        [sys.executable, "-m", "tools.diagnose", "batch", "--preset", "tiny", "--model",
         str(out / "checkpoint-2"), "--dataset", tiny_args[5], "--prompts-per-step", "2",
         "--max-completion-length", "6", "--reward-workers", "1",
         "--diagnostics-dir", str(tmp_path / "diag")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert diagnosed.returncode == 0, diagnosed.stderr[-2000:]
    assert not marker.exists()  # nothing of the file ran, anywhere


class Poison:
    """A pickle whose loading runs a shell command (here: touching a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


OLD_CHECKPOINT = ROOT / "tests" / "fixtures" / "checkpoint-of-2026-12-03"


class NoState:
    """A part of a run that loads no state: what a resume that forgets that part does."""

    def load_state_dict(self, state) -> None:
        pass


def forgetting(part: str):
    """checkpoints.restore, made to leave one of the parts it restores as it was."""
    return lambda restore: lambda path, parts: restore(path, parts | {part: NoState()})


def rng_left_alone(restore):
    def restore_but_the_rng(path, parts):
        with checkpoints.rng_kept():
            return restore(path, parts)

    return restore_but_the_rng


def data_position_lost(restore):
    return lambda path, parts: restore(path, parts) | {"data_position": 0}


# What a resume could lose: the defect in checkpoints.restore, and what the check must then name
RESUME_DEFECTS = {
    "optimizer": (forgetting("optimizer"), "AdamW's state"),
    "scheduler": (forgetting("scheduler"), "the learning rates"),
    "rng": (rng_left_alone, "torch's RNG state"),
    "data position": (data_position_lost, "the step's prompts"),
}


def resumed_from_old_checkpoint(folder: Path, monkeypatch) -> dict:
    """Resume the 12-03 run folder's checkpoint-2 (tests/fixtures/) in this process for steps 3-4,
    and what its first resumed step started from: the batch, the RNG states and the trained
    weights as it began sampling, AdamW's state and learning rate as it began the optimizer step;
    and the records. Each is what the processor computes with, not what it computes, so the check
    holds on any CPU."""
    seen = {}
    sample, adamw_step = cwgrpo.sample, torch.optim.AdamW.step
    next_batch = PromptStream.next_batch

    def first_batch(stream, n: int):
        batch = next_batch(stream, n)
        seen.setdefault("batch", batch)
        return batch

    def first_sample(model, tokenizer, prompts, cfg, **options):
        if "rng" not in seen:
            trained = {
                n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad
            }
            seen.update(rng=checkpoints.rng_states(), trained=trained)
        return sample(model, tokenizer, prompts, cfg, **options)

    def first_step(optimizer, *args, **kwargs):
        if "optimizer" not in seen:
            seen["optimizer"] = copy.deepcopy(optimizer.state_dict())
        return adamw_step(optimizer, *args, **kwargs)

    monkeypatch.setattr(cwgrpo, "sample", first_sample)
    monkeypatch.setattr(PromptStream, "next_batch", first_batch)
    monkeypatch.setattr(torch.optim.AdamW, "step", first_step)
    monkeypatch.chdir(folder)
    args = ["--preset", "tiny", "--model", "base", "--dataset", "data.jsonl", "--steps", "4"]
    args += ["--save-every", "2", "--threads", "1", "--reward-workers", "1", *LORA_ARGS]
    args += ["--no-share-prompts"]  # as the run was made
    threads = torch.get_num_threads()  # --threads sets the process's
    try:
        cwgrpo.main(*cwgrpo.parse_config([*args, "--output-dir", "run", "--resume"]))
    finally:
        torch.set_num_threads(threads)
    return seen | {"records": read_metrics(folder / "run" / "metrics.jsonl")}


def old_checkpoint_mismatches(resumed: dict) -> list[str]:
    """What of the resumed run's first step differs from the 12-03 checkpoint's state and from
    that day's uninterrupted run where no rounding enters: the RNG states, trained weights and
    AdamW moments as the files hold them; the learning rates as the uninterrupted records have
    them; the step's prompts as a twin data stream on this machine serves its third step's; the
    first two records kept as written."""
    checkpoint = OLD_CHECKPOINT / "run" / "checkpoint-2"
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    moments = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    adapter = safetensors.torch.load_file(checkpoint / "adapter_model.safetensors")
    uninterrupted = read_metrics(OLD_CHECKPOINT / "uninterrupted.jsonl")
    cfg, _ = cwgrpo.parse_config(["--preset", "tiny", "--model", str(OLD_CHECKPOINT / "base")])
    dataset = loading.load_dataset(
        str(OLD_CHECKPOINT / "data.jsonl"), "train", "problem", "solution"
    )
    tokenizer = loading.load_tokenizer(str(OLD_CHECKPOINT / "base"))
    twin = PromptStream(dataset, tokenizer, cfg)
    twin.next_batch(2 * cfg.prompts_per_step)  # steps 1 and 2
    wrong = []
    if not torch.equal(resumed["rng"]["torch"], state["rng"]["torch"]):
        wrong.append("torch's RNG state")
    if resumed["rng"]["python"] != state["rng"]["python"]:
        wrong.append("Python's RNG state")
    trained = {name.replace(".default.", "."): p for name, p in resumed["trained"].items()}
    if trained.keys() != adapter.keys() or any(
        not torch.equal(p, adapter[name]) for name, p in trained.items()
    ):
        wrong.append("the trained weights")
    restored = resumed["optimizer"]["state"]
    if restored.keys() != moments.keys() or any(
        not torch.equal(restored[i][key], moments[i][key]) for i in moments for key in moments[i]
    ):
        wrong.append("AdamW's state")
    if [r["lr"] for r in resumed["records"]] != [r["lr"] for r in uninterrupted]:
        wrong.append("the learning rates")
    if resumed["batch"] != twin.next_batch(cfg.prompts_per_step):
        wrong.append("the step's prompts")
    skipped = [r.get("skipped_steps") for r in resumed["records"]]  # counted since 12-03 only
    if resumed["records"][:2] != uninterrupted[:2] or skipped != [None, None, 0, 0]:
        wrong.append("the records of steps 1-2")
    return wrong


def test_a_checkpoint_written_by_main_of_2026_12_03_resumes_with_all_its_state(
    tmp_path, monkeypatch
):
    """A run folder from before checkpoints were read with weights_only (tests/fixtures/): its
    checkpoint-2 resumes with today's code from exactly the state that day's run held."""
    shutil.copytree(OLD_CHECKPOINT, tmp_path / "folder")
    resumed = resumed_from_old_checkpoint(tmp_path / "folder", monkeypatch)
    assert old_checkpoint_mismatches(resumed) == []


@pytest.mark.parametrize("defect", RESUME_DEFECTS)
def test_the_old_checkpoints_check_sees_each_part_of_the_state_a_resume_could_lose(
    defect, tmp_path, monkeypatch
):
    """The check above, against a resume that forgets one part of the state: it names that."""
    defective, named = RESUME_DEFECTS[defect]
    monkeypatch.setattr(checkpoints, "restore", defective(checkpoints.restore))
    shutil.copytree(OLD_CHECKPOINT, tmp_path / "folder")
    resumed = resumed_from_old_checkpoint(tmp_path / "folder", monkeypatch)
    assert named in old_checkpoint_mismatches(resumed)
