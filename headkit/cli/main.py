"""The ``headkit`` command line: ``probe``, ``train``, ``eval``, ``predict``, ``demo``,
``convert``, ``export`` and ``push``.

Runs as ``headkit ...`` (console script) or ``python -m headkit ...``. This module holds the
parser and the dispatch; each command is a module with ``add_arguments(parser)`` (argparse
only, so ``--help`` prints without importing torch) and ``run(args)``; every command also
takes ``--threads`` and ``--device`` (its ``DEVICE_HELP`` says what the device is for there;
a device torch does not see is one error naming ``--device``). Each command's
``--help`` ends with an example. A bad argument exits with status 2 and one line that names
the argument, its value and what is allowed (a missing column lists the columns present).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from ..errors import HeadkitError
from . import convert, demo, evaluate, export, predict, probe, push, train
from .options import add_device, add_threads

#: Command name -> its module (``HELP``, ``EXAMPLE``, ``add_arguments``, ``run``).
COMMANDS = {
    "probe": probe,
    "train": train,
    "eval": evaluate,
    "predict": predict,
    "demo": demo,
    "convert": convert,
    "export": export,
    "push": push,
}

#: An error's ``field`` (``HeadkitError.field``) -> the option it is reported as, where the
#: command has that option: library arguments by their option names, positionals as named.
_FIELD_OPTIONS = {
    "layers": "--layers",
    "pooling": "--pooling",
    "task": "--task",
    "val_splits": "--val-splits",
    "l2": "--l2",
    "model": "--model",
    "data": "--data",
    "CONFIG": "CONFIG",
    "CHECKPOINT": "CHECKPOINT",
    "OUT": "OUT",
}


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the whole usage first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="headkit",
        description="Attach, train, save, load and probe heads on Hugging Face transformers.",
        epilog="example:\n  headkit demo\n  headkit probe --model packaged:minilm --data "
        "packaged:rotten_tomatoes --limit 500 --output runs/probe\n"
        "run 'headkit COMMAND --help' for a command's options and an example",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, module in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            epilog=module.EXAMPLE,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        add_threads(p)  # every command: --threads and --device (where its model is loaded)
        add_device(p, getattr(module, "DEVICE_HELP", "where the model runs"))
        p.set_defaults(run=module.run)
    return parser


#: Options whose values may start with "-" (``--layers -4:``): argparse would read such a
#: value as an option, so it is joined to its option (``--layers=-4:``) before parsing.
_DASH_VALUES = ("--layers",)


def _join_dash_values(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _DASH_VALUES and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Run a command; return its exit status (2 for bad arguments or inputs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(_join_dash_values(argv))
    try:
        with _progress_bars(not getattr(args, "quiet", False)), _threads(args.threads):
            args.run(args)
    except HeadkitError as e:
        message = " ".join(str(e).split())
        option = _FIELD_OPTIONS.get(e.field) if isinstance(e.field, str) else None
        option = option if option is not None and _has(args, option) else None
        prefix = f"argument {option}: " if option else ""
        print(f"headkit {args.command}: error: {prefix}{message}", file=sys.stderr)
        return 2
    return 0


def _has(args: argparse.Namespace, option: str) -> bool:
    """Whether this command has ``option`` (so an error can be reported as that argument's)."""
    return hasattr(args, option.lstrip("-").replace("-", "_").lower())


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """``--threads N``: torch's CPU threads for the command (OMP_NUM_THREADS for a torch
    imported later, ``torch.set_num_threads`` for one already imported); then as it was."""
    if n is None:
        yield
        return
    import os

    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
        if before is not None:
            torch.set_num_threads(before)


@contextlib.contextmanager
def _quiet_environment() -> Iterator[None]:
    """``--quiet`` before transformers is imported (importing it to switch its bars off
    costs seconds, before the arguments are checked): huggingface_hub's bars off (what
    transformers reads when imported) and ``TRANSFORMERS_VERBOSITY=error``; if the command
    imported transformers, its bars and logging are set back afterwards."""
    import logging as std_logging
    import os
    import warnings

    from huggingface_hub import utils as hub  # light: no torch, no transformers

    hub_off = hub.are_progress_bars_disabled()
    hub_logger = std_logging.getLogger("huggingface_hub")
    hub_level = hub_logger.level
    saved = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    hub.disable_progress_bars()
    hub_logger.setLevel(std_logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"(transformers|huggingface_hub)(\.|$)")
            yield
    finally:
        if saved is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = saved
        hub_logger.setLevel(hub_level)
        if "transformers" in sys.modules:  # imported by the command: as it would have been
            from .._transformers import default_logging_level, logging

            logging.set_verbosity(default_logging_level())
            if not hub_off:
                logging.enable_progress_bar()  # turns huggingface_hub's on as well
        elif not hub_off:
            hub.enable_progress_bars()


@contextlib.contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """With ``shown=False`` (``--quiet``), transformers' and huggingface_hub's own bars
    (``Loading weights``) are off while the command runs, their logging (load reports,
    advice) shows errors only and their Python warnings none; then all is as it was
    (``main`` may run in a process that keeps going, e.g. a test or a notebook)."""
    if shown:
        yield
        return
    import logging as std_logging
    import warnings

    if "transformers" not in sys.modules:  # not imported yet: the environment, not an import
        with _quiet_environment():
            yield
        return
    from huggingface_hub import utils as hub

    from .._transformers import logging

    were_shown, hub_off = logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()
    verbosity = logging.get_verbosity()
    hub_logger = std_logging.getLogger("huggingface_hub")
    hub_level = hub_logger.level
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    hub_logger.setLevel(std_logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"(transformers|huggingface_hub)(\.|$)")
            yield
    finally:
        logging.set_verbosity(verbosity)
        hub_logger.setLevel(hub_level)
        if were_shown:
            logging.enable_progress_bar()  # turns huggingface_hub's on as well
        (hub.disable_progress_bars if hub_off else hub.enable_progress_bars)()
