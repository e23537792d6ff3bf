"""The docs as a new user meets them: every shell command in README.md and docs/ runs as written
in a fresh clone after the quick start, and every relative link and image there resolves.

A command whose comment carries a marker is skipped, and pytest's summary says so with the
marker's reason (`pytest -rs`): [gpu] needs a CUDA card, [hub] the Hugging Face Hub, [long] takes
minutes or more (or serves until stopped), [install] changes the environment, [optional] needs a
package requirements.txt leaves out (vLLM, verl, W&B), [ci] is a test suite CI runs on its own.
Every other command runs, in the order the docs give them, from one clone: the quick start's run
first, as the README has it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

MARKERS = {
    "gpu": "needs a CUDA card",
    "hub": "needs the Hugging Face Hub",
    "long": "takes minutes or more, or serves until stopped",
    "install": "changes the environment",
    "optional": "needs a package requirements.txt leaves out",
    "ci": "a test suite, which CI runs as a step of its own",
}
QUICK_START = "python cwgrpo.py --method cw --preset tiny"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def shell_commands(page: Path) -> list[tuple[str, str]]:
    """(where, command) for each command of the page's bash blocks, continuation lines joined."""
    commands = []
    text = page.read_text()
    for block in FENCE.finditer(text):
        if block.group(1) not in ("bash", "sh", "shell"):
            continue
        line = text[: block.start(2)].count("\n") + 1
        pending = ""
        for offset, raw in enumerate(block.group(2).splitlines()):
            pending += raw.rstrip("\\").rstrip() + " " if raw.endswith("\\") else raw
            if raw.endswith("\\"):
                continue
            if pending.strip() and not pending.lstrip().startswith("#"):
                where = f"{page.relative_to(ROOT)}:{line + offset}"
                commands.append((where, re.sub(r"\s+", " ", pending).strip()))
            pending = ""
    return commands


COMMANDS = [command for page in PAGES for command in shell_commands(page)]


def marker(command: str) -> str | None:
    """The marker in the command's comment, if any."""
    comment = command.partition(" #")[2]
    found = re.search(r"\[(\w+)\]", comment)
    return found.group(1) if found else None


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A fresh clone's files (tracked, and new ones git does not ignore) after the quick start."""
    folder = tmp_path_factory.mktemp("clone")
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(source.read_bytes())
    return folder, shell(QUICK_START, folder)


def shell(command: str, folder: Path) -> subprocess.CompletedProcess:
    """The command through bash in `folder`, `python` this venv's, without a GPU or the hub."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        ["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=900
    )


def test_every_page_gives_commands_and_the_readme_the_quick_start():
    assert len(COMMANDS) > 40
    assert any(command.startswith(QUICK_START + " ") for _, command in COMMANDS)
    unknown = {marker(c) for _, c in COMMANDS} - {None, *MARKERS}
    assert not unknown, f"markers without a reason in MARKERS: {unknown}"


@pytest.mark.parametrize("where,command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_doc_command_runs_as_written(clone, where, command):
    found = marker(command)
    if found:
        pytest.skip(f"[{found}]: {MARKERS[found]}")
    folder, quick_start = clone
    done = quick_start if command.startswith(QUICK_START + " ") else shell(command, folder)
    assert done.returncode == 0, f"{where}: {command}\n{(done.stdout + done.stderr)[-3000:]}"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces
    as -, a repeated one numbered."""
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def notebook_anchors(notebook: Path) -> set[str]:
    """The anchors a notebook's markdown cells set (<a id="...">), which its renderers keep."""
    cells = json.loads(notebook.read_text())["cells"]
    markdown = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return set(re.findall(r'<a id="([^"]+)">', markdown))


def test_every_relative_link_and_image_in_the_docs_resolves():
    broken = []
    for page in [*PAGES, *ROOT.glob("*/README.md")]:
        prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
        for target in LINK.findall(prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
            elif (
                anchor and resolved.suffix == ".ipynb" and anchor not in notebook_anchors(resolved)
            ):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such anchor)")
    assert not broken, "\n".join(broken)


def collected(*paths: str) -> int:
    """How many tests pytest collects from paths, as the README's commands run them."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *paths],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("CWGRPO_TEST_")},
    )  # fmt: skip
    return int(re.search(r"(\d+) tests? collected", done.stdout).group(1))


def test_the_readme_counts_the_tests_it_names():
    readme = (ROOT / "README.md").read_text()
    focused = re.search(r"The focused tests \((\d+)[,;]", readme)
    system = re.search(r"`python -m pytest -q tests` \((\d+) more", readme)
    assert focused and system, "the README names no count where this test reads one"
    assert int(focused.group(1)) == collected("test_cwgrpo.py")
    assert int(system.group(1)) == collected("tests")
