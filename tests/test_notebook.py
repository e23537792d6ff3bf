"""docs/one-step.ipynb, executed in a real Jupyter kernel as a reader runs it: no cell raises, and
the outputs it holds are what this code prints and draws (tools/notebook.py; the printed numbers
on the CPU that made them). Needs nbclient and ipykernel, which CI installs in its venv; without
them that test is skipped."""

import pytest

from tests.support import ROOT
from tools import notebook

NOTEBOOK = ROOT / "docs" / "one-step.ipynb"


def printing(text: str, pictures: int = 0) -> dict:
    """A code cell that printed text and drew that many pictures, as a notebook's JSON holds it."""
    picture = {"output_type": "display_data", "data": {"image/png": "", "text/plain": "<Figure>"}}
    stream = {"output_type": "stream", "name": "stdout", "text": text}
    return {"cell_type": "code", "outputs": [stream] + [picture] * pictures}


def notebook_of(*cells, made_on: str = "") -> dict:
    page = {"cell_type": "markdown", "source": "# a page"}
    return {"cells": [page, *cells], "metadata": {"outputs_made_on": made_on}}


def test_outputs_of_other_code_are_told_apart_from_another_cpus_last_digit():
    held = notebook_of(printing("loss +0.012345, sigma 0.2500 of 14 tokens\n", pictures=1))
    last_digit = notebook_of(printing("loss +0.012346, sigma 0.2501 of 14 tokens\n", pictures=1))
    assert notebook.differences(held, last_digit) == []
    other_number = notebook_of(printing("loss +0.012347, sigma 0.2500 of 14 tokens\n", pictures=1))
    assert notebook.differences(held, other_number) == [
        "code cell 1: prints +0.012347 where it held +0.012345"
    ]
    other_count = notebook_of(printing("loss +0.012345, sigma 0.2500 of 15 tokens\n", pictures=1))
    assert notebook.differences(held, other_count) == ["code cell 1: prints 15 where it held 14"]
    other_words = notebook_of(printing("loss +0.012345, sigma 0.2500 of 14 positions\n", 1))
    assert notebook.differences(held, other_words) == [
        "code cell 1: prints other words than the held outputs"
    ]
    no_picture = notebook_of(printing("loss +0.012345, sigma 0.2500 of 14 tokens\n"))
    assert notebook.differences(held, no_picture) == ["code cell 1: 0 pictures, 1 held"]
    # another CPU: the pictures compared, not the texts
    assert notebook.differences(held, other_words, texts=False) == []
    assert notebook.differences(held, no_picture, texts=False) == [
        "code cell 1: 0 pictures, 1 held"
    ]


def test_texts_are_compared_only_on_the_cpu_that_made_them():
    fresh = notebook_of(printing("loss 2.5\n", pictures=1))
    here = notebook_of(printing("loss 1.5\n", pictures=1), made_on=notebook.machine())
    assert notebook.check(here, fresh)[0] == ["code cell 1: prints 2.5 where it held 1.5"]
    elsewhere = notebook_of(printing("loss 1.5\n", pictures=1), made_on="another CPU (avx2)")
    assert notebook.check(elsewhere, fresh) == ([], "(pictures only: made on another CPU (avx2))")


def test_the_one_step_notebook_runs_in_a_kernel_and_holds_this_codes_outputs():
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    found, compared = notebook.check(notebook.read(NOTEBOOK), notebook.executed(NOTEBOOK))
    assert found == [], compared
