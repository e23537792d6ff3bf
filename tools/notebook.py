"""A notebook executed in a fresh Jupyter kernel from the clone's root, as a reader runs it: its new
outputs written into it with the CPU that made them (--write), or compared with the ones it holds.
Every cell must run, and draw the pictures it held. On the CPU that made the outputs (its model and
vector instruction sets), each code cell's printed text must match too: the words exactly, each
number to within one unit of its last printed digit. Another CPU rounds differently, which can
change what the model samples, so there the text is not compared, and the check says so. Needs
nbclient and ipykernel, which requirements.txt leaves out (pip install nbclient ipykernel).

    python -m tools.notebook docs/one-step.ipynb          # run it; say where it differs
    python -m tools.notebook docs/one-step.ipynb --write  # run it; keep the new outputs
"""

import argparse
import importlib
import platform
import re
from decimal import Decimal
from pathlib import Path

from cwgrpo_utils import REPOSITORY
from cwgrpo_utils.options.cli import require

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def machine() -> str:
    """The CPU the printed numbers depend on: its model name and the vector instruction sets that
    torch's kernels choose between."""
    cpuinfo = Path("/proc/cpuinfo")
    info = cpuinfo.read_text() if cpuinfo.exists() else ""
    name = re.search(r"model name\s*:\s*(.+)", info)
    flags = re.search(r"flags\s*:\s*(.+)", info)
    vector = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"}
    found = sorted(vector & set(flags.group(1).split())) if flags else []
    return f"{name.group(1).strip() if name else platform.machine()} ({' '.join(found)})"


def read(path: Path):
    """The notebook at path (nbformat's NotebookNode, a dict whose texts are joined)."""
    require("nbclient", "python -m tools.notebook")  # nbformat comes with it
    return importlib.import_module("nbformat").read(path, as_version=4)


def executed(path: Path, timeout_s: int = 600):
    """The notebook at path, run cell by cell in a new kernel whose working folder is the clone's
    root; a cell that raises stops it with that cell's error."""
    require("ipykernel", "python -m tools.notebook")
    notebook = read(path)
    client = importlib.import_module("nbclient").NotebookClient(
        notebook,
        timeout=timeout_s,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(REPOSITORY)}},
    )
    client.execute()
    return notebook


def printed(cell: dict) -> tuple[str, int]:
    """A code cell's printed text (its standard output and plain-text results) and how many
    pictures it drew."""
    text, pictures = "", 0
    for output in cell["outputs"]:
        if output["output_type"] == "stream" and output["name"] == "stdout":  # not warnings
            text += output["text"]
        elif "data" in output:
            pictures += "image/png" in output["data"]
            if "image/png" not in output["data"]:
                text += output["data"].get("text/plain", "")
    return text, pictures


def same_number(held: str, fresh: str) -> bool:
    """Equal, or for numbers with decimals one unit of the last printed digit apart (a count is
    exact)."""
    if held == fresh:
        return True
    if not any(mark in held + fresh for mark in ".e"):
        return False
    exponent = min(Decimal(held).as_tuple().exponent, Decimal(fresh).as_tuple().exponent)
    return abs(Decimal(held) - Decimal(fresh)) <= Decimal(1).scaleb(exponent)


def differences(held: dict, fresh: dict, texts: bool = True) -> list[str]:
    """Where the fresh execution's code cells (a notebook's JSON) draw, or with texts print, what
    the held notebook's do not, one line each: the cell's number and the first difference."""
    found = []
    cells = zip(held["cells"], fresh["cells"])
    code = [(h, f) for h, f in cells if h["cell_type"] == "code"]
    for number, (held_cell, fresh_cell) in enumerate(code, 1):
        (held_text, held_pictures), (fresh_text, fresh_pictures) = (
            printed(held_cell),
            printed(fresh_cell),
        )
        if held_pictures != fresh_pictures:
            found.append(f"code cell {number}: {fresh_pictures} pictures, {held_pictures} held")
        if not texts:
            continue
        if NUMBER.split(held_text) != NUMBER.split(fresh_text):
            found.append(f"code cell {number}: prints other words than the held outputs")
            continue
        for a, b in zip(NUMBER.findall(held_text), NUMBER.findall(fresh_text)):
            if not same_number(a, b):
                found.append(f"code cell {number}: prints {b} where it held {a}")
                break
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--write", action="store_true", help="keep the new outputs in the notebook")
    args = parser.parse_args(argv)
    fresh = executed(args.notebook)
    if args.write:
        fresh.metadata["outputs_made_on"] = machine()
        importlib.import_module("nbformat").write(fresh, args.notebook)
        print(f"{args.notebook}: executed on {machine()}, its outputs written")
        return
    found, note = check(read(args.notebook), fresh)
    print("\n".join(found) or f"{args.notebook}: executed, its outputs as held {note}")
    raise SystemExit(1 if found else 0)


def check(held, fresh) -> tuple[list[str], str]:
    """differences(), the texts compared where this CPU made the held outputs; and which it was."""
    made_on = held["metadata"].get("outputs_made_on")
    if made_on == machine():
        return differences(held, fresh), f"(on {made_on}, texts and pictures)"
    return differences(held, fresh, texts=False), f"(pictures only: made on {made_on})"


if __name__ == "__main__":
    main()
