"""Shared-prompt passes (--share-prompts, cwgrpo_utils/fast/shared_prompt.py) against the unshared
ones, in fp32 on the CPU: the same log-probs, entropies, ict divergences and parameter gradients to
rounding on three model shapes, with left-padded prompts of different lengths, one group and
several a micro-batch, LoRA and gradient checkpointing; the same sampled tokens; and a short run's
records."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from cwgrpo_utils.fast import shared_prompt
from cwgrpo_utils.fast.shared_prompt import length_buckets
from cwgrpo_utils.machine.precision import Precision
from cwgrpo_utils.models import loading, lora
from tests.support import SMALL_SHAPE, read_metrics
from tools import diagnose

GROUP = 4
# SmolLM2-135M's shape scaled down: tied embeddings, 9 heads over 3 KV heads, a Llama
SMOLLM2_SHAPED = dict(
    vocab_size=500,
    hidden_size=72,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)


@pytest.fixture(scope="module")
def models(tiny_base):
    torch.manual_seed(0)
    return {
        "tiny": loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu")),
        "smollm2-shaped": LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPED)),
        "qwen2-shaped": Qwen2ForCausalLM(Qwen2Config(**SMALL_SHAPE)),
    }


def grouped_rollout(vocab: int, prompt_lengths=(9, 5, 12), completion_length=7) -> cwgrpo.Batch:
    """Groups of GROUP rows, each group one left-padded prompt (of its own length) and GROUP
    completions of random lengths, random advantages: what sampling and the rewards hand the
    update."""
    generator = torch.Generator().manual_seed(1)
    width = max(prompt_lengths)
    prompt_ids = torch.zeros(len(prompt_lengths), width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row, length in enumerate(prompt_lengths):
        prompt_ids[row, width - length :] = torch.randint(0, vocab, (length,), generator=generator)
        prompt_mask[row, width - length :] = 1
    rows = len(prompt_lengths) * GROUP
    completion_mask = torch.ones(rows, completion_length)
    for row in range(rows):
        length = int(torch.randint(1, max(completion_length, 1) + 1, (1,), generator=generator))
        completion_mask[row, length:] = 0
    samples = cwgrpo.Samples(
        prompt_ids.repeat_interleave(GROUP, 0),
        prompt_mask.repeat_interleave(GROUP, 0),
        torch.randint(0, vocab, (rows, completion_length), generator=generator),
        completion_mask,
        torch.zeros(rows, dtype=torch.bool),
        [""] * rows,
        torch.zeros(rows, completion_length),
    )
    zeros = torch.zeros(rows)
    rewards = cwgrpo.Rewards(zeros, accuracy=zeros, format=zeros)
    advantages = torch.randn(rows, generator=generator)
    return cwgrpo.Batch.of(samples, rewards, advantages, old=None, ref_logp=None)


def passes(model, rollout, share: bool, groups_per_micro_batch: int) -> dict:
    """The no-grad pass's log-probs, entropies and ict divergences, and the update's gradients."""
    options = ["--preset", "tiny", "--group-size", str(GROUP), "--prompts-per-step", "3"]
    options += ["--groups-per-micro-batch", str(groups_per_micro_batch), "--beta", "0"]
    cfg, run_cfg = cwgrpo.parse_config([*options, "--share-prompts", str(share)])
    log_prob_passes = cwgrpo.Passes.of(cfg, run_cfg)
    stats = cwgrpo.token_stats(model, rollout, cfg, log_prob_passes, divergence=True)._asdict()
    model.zero_grad(set_to_none=True)
    autocast = Precision.choose("fp32", torch.device("cpu")).autocast
    diagnose.step_gradient(model, rollout, cfg, log_prob_passes, autocast)
    stats["gradients"] = {
        name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
    }
    return stats


def assert_gradients_agree(shared: dict, unshared: dict) -> None:
    """Within 1e-5 of the whole gradient's norm; a tensor alone within 3e-5 of its own (a few,
    such as k_proj's bias over one group, are mostly cancellation), or exactly 0 where the
    unshared one is (LoRA's A while B is 0; no completion token at all)."""
    assert shared.keys() == unshared.keys() and len(unshared) > 0
    pairs = [(shared[name], gradient) for name, gradient in unshared.items()]
    whole = torch.cat([g.flatten() for _, g in pairs]).norm()
    assert torch.cat([(s - g).flatten() for s, g in pairs]).norm() <= 1e-5 * whole
    for s, g in pairs:
        assert (s - g).norm() <= 3e-5 * g.norm() if g.norm() else not s.any()


@pytest.mark.parametrize(
    "shape,checkpointing,lora_rank,groups_per_micro_batch",
    [
        ("tiny", False, 0, 0),
        ("tiny", True, 0, 0),
        ("tiny", False, 0, 1),
        ("tiny", False, 4, 0),
        ("tiny", True, 4, 1),
        ("smollm2-shaped", False, 0, 0),
        ("smollm2-shaped", True, 4, 1),
        ("qwen2-shaped", False, 0, 1),
        ("qwen2-shaped", True, 0, 0),
        ("qwen2-shaped", False, 4, 0),
    ],
)
def test_a_shared_prompt_pass_is_the_unshared_one_to_rounding(
    models, shape, checkpointing, lora_rank, groups_per_micro_batch
):
    model = copy.deepcopy(models[shape])
    if lora_rank:
        model = lora.adapted(model.requires_grad_(False), lora_rank, 16, "all-linear")
    if checkpointing:
        loading.enable_checkpointing(model)
    rollout = grouped_rollout(model.config.vocab_size)
    unshared, shared = (passes(model, rollout, s, groups_per_micro_batch) for s in (False, True))
    valid = rollout.completion_mask.bool()
    for name in ("logp", "entropy", "divergence"):
        torch.testing.assert_close(shared[name][valid], unshared[name][valid], rtol=0, atol=1e-5)
        assert (shared[name][~valid] == 0).all()
    assert_gradients_agree(shared["gradients"], unshared["gradients"])


@pytest.mark.parametrize("completion_length", [0, 1, 2])
def test_completions_of_no_token_or_one_share_their_prompt_too(models, completion_length):
    model = copy.deepcopy(models["tiny"])
    rollout = grouped_rollout(model.config.vocab_size, completion_length=completion_length)
    unshared, shared = (passes(model, rollout, s, groups_per_micro_batch=0) for s in (False, True))
    torch.testing.assert_close(shared["logp"], unshared["logp"], rtol=0, atol=1e-5)
    assert_gradients_agree(shared["gradients"], unshared["gradients"])


def test_rows_are_bucketed_by_length_where_that_saves_padded_positions():
    # as SmolLM2's first batch on sums: one bucket costs 16 x 48 + 256 = 1,024 positions; the 13
    # rows up to 13 and the 3 from 18 cost 169 + 144 + 2 x 256 = 825, less than any other split
    # (at 18: 252 + 96 + 512 = 860; three buckets: 1,051 or more)
    lengths = torch.tensor([8, 47, 3, 8, 9, 10, 8, 11, 13, 18, 8, 9, 48, 10, 8, 11])
    short, long = length_buckets(lengths)
    assert sorted(long.tolist()) == [1, 9, 12]
    assert sorted(short.tolist() + long.tolist()) == list(range(16))
    assert [len(b) for b in length_buckets(torch.tensor([5, 6, 7, 8]))] == [4]  # nothing to save
    assert length_buckets(torch.tensor([0, 0])) and length_buckets(torch.tensor([3]))


def test_a_pass_in_many_buckets_is_the_unshared_one_to_rounding(models, monkeypatch):
    monkeypatch.setattr(shared_prompt, "PASS_POSITIONS", 0)  # a bucket for every length
    model = copy.deepcopy(models["qwen2-shaped"])
    loading.enable_checkpointing(model)
    rollout = grouped_rollout(model.config.vocab_size, completion_length=9)
    needed = rollout.completion_mask.sum(1).long() - 1
    assert len(length_buckets(needed)) == len(set(needed.tolist())) > 3
    unshared, shared = (passes(model, rollout, s, groups_per_micro_batch=0) for s in (False, True))
    valid = rollout.completion_mask.bool()
    for name in ("logp", "entropy", "divergence"):
        torch.testing.assert_close(shared[name][valid], unshared[name][valid], rtol=0, atol=1e-5)
    assert_gradients_agree(shared["gradients"], unshared["gradients"])


def test_rows_of_a_group_with_different_prompts_cannot_share_one(models):
    model = models["tiny"]
    rollout = grouped_rollout(model.config.vocab_size)
    rollout.prompt_ids[1, -1] += 1  # the first group's second row: another prompt
    with pytest.raises(ValueError, match="rows of a group of 4 hold different prompts"):
        cwgrpo.completion_states(model, rollout, GROUP, share_prompts=True)


def test_sampling_prefills_each_prompt_once_and_draws_the_same_tokens(models):
    model = models["smollm2-shaped"].eval()
    rollout = grouped_rollout(model.config.vocab_size)
    how = cwgrpo.Sampling(GROUP, 1.0, 1.0, 0, 12)
    drawn = {}
    for share in (False, True):
        torch.manual_seed(5)
        with torch.no_grad():
            drawn[share] = cwgrpo.sample_tokens(
                model, rollout.prompt_ids, rollout.prompt_mask, how, 12, [], 0, share=share
            )
    assert torch.equal(drawn[True][0], drawn[False][0])
    torch.testing.assert_close(drawn[True][1], drawn[False][1], rtol=0, atol=1e-5)


def test_three_tiny_steps_shared_and_unshared_sample_alike_and_agree_to_rounding(
    tiny_args, tmp_path
):
    records = {}
    for share in (False, True):
        out = tmp_path / str(share)
        args = [*tiny_args, "--steps", "3", "--share-prompts", str(share), "--output-dir", str(out)]
        cwgrpo.main(*cwgrpo.parse_config(args))
        records[share] = read_metrics(out / "metrics.jsonl")
    for unshared, shared in zip(records[False], records[True], strict=True):
        for key in ("reward_mean", "reward_std", "accuracy_mean", "completion_len_mean"):
            assert shared[key] == unshared[key], key
        for key in ("loss", "entropy_mean", "kl_mean", "grad_norm"):
            assert shared[key] == pytest.approx(unshared[key], rel=1e-4, abs=1e-9), key


@pytest.fixture
def two_threads():
    """torch on two threads for the test, as before after it: --threads and set_num_threads set
    the process's, and the tests after it compare runs with the session's one-thread run."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_run_on_two_threads_repeats_itself_to_the_bit(tiny_args, tmp_path, two_threads):
    """The same seed on the same CPU and thread count gives the same records, every key but the
    timings: two runs of the tiny preset on two threads parted within 15 steps while a group's
    prompt gradient was summed with atomic adds."""
    runs = []
    for name in ("first", "second"):
        out = tmp_path / name
        args = [*tiny_args, "--steps", "15", "--threads", "2", "--output-dir", str(out)]
        cwgrpo.main(*cwgrpo.parse_config(args))
        runs.append(read_metrics(out / "metrics.jsonl"))
    timings = {"rollout_s", "update_s", "time", "tokens_per_s"}
    for first, second in zip(*runs, strict=True):
        assert {k: v for k, v in first.items() if k not in timings} == {
            k: v for k, v in second.items() if k not in timings
        }


def test_a_groups_prompt_gradient_is_summed_in_the_same_order_every_time_on_two_threads(
    two_threads,
):
    """PromptCache hands each completion row its group's prompt keys and values; backward sums
    the rows' gradients into the group's. In a fixed order, so a run repeats itself bit for bit at
    a given thread count: an indexed gather's backward adds with atomics across threads, and two
    runs of the tiny preset on two threads parted after about ten steps."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randn(8, 1, 40, 32, generator=generator) for _ in range(2)]  # keys, values
    shuffled = torch.randperm(64, generator=generator)[:50]  # rows by length
    group_of_row = (torch.arange(64) // 8)[shuffled]
    own = torch.randn(50, 1, 20, 32, generator=generator)  # the completions' own keys, values
    upstream = torch.randn(50, 1, 60, 32, generator=generator)

    def prompt_gradients() -> list[torch.Tensor]:
        keys, values = (p.clone().requires_grad_() for p in prompts)
        cache = shared_prompt.PromptCache([SimpleNamespace(keys=keys, values=values)], group_of_row)
        keys_seen, values_seen = cache.update(own, own, layer_idx=0)  # (50, 1, 60, 32) each
        ((keys_seen + values_seen) * upstream).sum().backward()
        return [keys.grad, values.grad]

    first, *again = (prompt_gradients() for _ in range(50))
    assert all(torch.equal(g, f) for gradients in again for g, f in zip(gradients, first))
