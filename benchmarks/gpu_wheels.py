"""What the GPU machine's image lacks, carried as wheels: gathered here, where a package index is
reachable, and installed there, where none is, before benchmarks.gpu_run.

    python -m benchmarks.gpu_wheels             # here: wheels/gpu/ (about 1.3 MB), for Python 3.12
    python3 -m benchmarks.gpu_wheels --install  # there: pip install --no-index from wheels/gpu/

The image (docs/gpu.md, "The next GPU run") has torch 2.11 for CUDA 13, transformers 5.17, peft,
pandas, pyarrow, matplotlib and the rest of benchmarks/gpu_image.txt, but not the packages below,
which cwgrpo.py imports (math-verify for the reward, datasets for the data). They are all pure
Python: one wheel each serves any machine of the Python version gathered for (multiprocess has a
wheel a version). They install with --no-deps: what they need besides one another is in the image,
and pip's resolver would otherwise refuse the image's newer fsspec for datasets' upper bound.
This module imports nothing but the standard library, so it runs before they are there.
"""

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

# The packages cwgrpo.py needs that the image lacks, at constraints.txt's versions
IMAGE_LACKS = {
    "datasets": "5.2.0",
    "dill": "0.4.1",  # datasets'
    "multiprocess": "0.70.19",  # datasets'
    "math-verify": "0.9.0",
    "latex2sympy2_extended": "1.11.0",  # math-verify's
    "antlr4-python3-runtime": "4.13.2",  # latex2sympy2_extended's
}
IMAGE_PYTHON = "3.12"  # the image's python3 (/opt/torch/.venv)
FOLDER = Path("wheels/gpu")  # ignored by git; the device call carries it


def gather(folder: Path, python: str) -> None:
    """Each package's wheel for CPython `python`, from the package index, into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version}" for name, version in IMAGE_LACKS.items()]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        + ["--python-version", python, "--implementation", "cp", "--dest", str(folder), *pins],
        check=True,
    )  # fmt: skip
    wheels = sorted(folder.glob("*.whl"))
    size = sum(path.stat().st_size for path in wheels)
    print(f"{folder}: {len(wheels)} wheels, {size / 2**20:.1f} MiB, for Python {python}")


def install(folder: Path) -> None:
    """The packages from folder's wheels alone (no index), then a line saying what is installed."""
    if not any(folder.glob("*.whl")):
        raise SystemExit(
            f"error: no wheels in {folder}; run python -m benchmarks.gpu_wheels where an index is "
            "reachable, and carry the folder with the command"
        )
    pins = [f"{name}=={version}" for name, version in IMAGE_LACKS.items()]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
        + ["--find-links", str(folder), *pins],
        check=True,
    )  # fmt: skip
    installed = {name: importlib.metadata.version(name) for name in IMAGE_LACKS}
    print("installed from " + f"{folder}: " + ", ".join(f"{k} {v}" for k, v in installed.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--install", action="store_true", help="install them here, no index")
    parser.add_argument("--folder", default=str(FOLDER), help=f"default {FOLDER}")
    parser.add_argument(
        "--python", default=IMAGE_PYTHON, help=f"gather for this Python (default {IMAGE_PYTHON})"
    )
    args = parser.parse_args()
    if args.install:
        install(Path(args.folder))
    else:
        gather(Path(args.folder), args.python)


if __name__ == "__main__":
    main()
