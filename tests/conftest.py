"""Fixtures of the system tests: a warm-started tiny model, its run arguments, and one short run."""

import json
import shutil

import pytest
import torch

import cwgrpo
from cwgrpo_utils.models import tiny
from tests.support import FEATURES, ROLLOUT

# One thread, as the runs the tests start choose for the tiny models: beside another busy process
# a second one makes them several times slower (docs/performance.md, "Threads on a shared CPU")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """The tiny preset's model and data, warm-started once for every test that trains."""
    return tiny.build(str(tmp_path_factory.mktemp("tiny-base")), warmstart_steps=150)


@pytest.fixture(scope="session")
def tiny_args(tiny_base):
    return [
        "--preset",
        "tiny",
        "--model",
        str(tiny_base / "model"),
        "--dataset",
        str(tiny_base / "arithmetic.jsonl"),
        "--rollout",
        ROLLOUT,
        *FEATURES,
    ]


@pytest.fixture(scope="session")
def TINY_RUN(tiny_args):  # noqa: N802 - the constant arguments of every short run
    return [*tiny_args, "--steps", "4", "--save-every", "2"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, TINY_RUN):
    """Four steps of the tiny preset with cw, a checkpoint every two."""
    out = tmp_path_factory.mktemp("run") / "cw"
    cwgrpo.main(*cwgrpo.parse_config([*TINY_RUN, "--output-dir", str(out)]))
    return out


@pytest.fixture(scope="session")
def eos_first_model(tiny_base, tmp_path_factory):
    """The tiny model with every token listed as EOS: every completion ends at its first token."""
    out = tmp_path_factory.mktemp("eos-first") / "model"
    shutil.copytree(tiny_base / "model", out)
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = list(
        range(json.loads((out / "config.json").read_text())["vocab_size"])
    )
    (out / "generation_config.json").write_text(json.dumps(config))
    return out
