"""``specdecode`` command line: the table of commands and ``main``; each command's flags and
run function live in a module of this package (``generate``, ``serve``, ``bench``, ...).

User errors (``SpecDecodeError``) print one line on stderr and exit with code 2, never a traceback.
The library's messages (``logging.getLogger("specdecode")``) reach the terminal as plain lines on
stderr, the text alone, as they would from ``print``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from specdecode.errors import SpecDecodeError
from specdecode.models.watch import WATCH


# Each command: its one line of help and the module of this package with its ``add_arguments``
# and run function.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("Generate text with or without speculative decoding.", "generate"),
    "models": ("List the named models or convert one now.", "models"),
    "index": ("Build or inspect a retrieval datastore for --method suffix.", "index"),
    "verify-cost": ("Measure what verifying K draft tokens costs against one token.", "verify_cost"),
    "bench": ("Benchmark methods and peers side by side on workloads or a Spec-Bench file.", "bench"),
    "serve": ("Serve the OpenAI API (completions, chat, streaming, /metrics) with speculative decoding.", "serve"),
    "calibrate": ("Choose the layers --method self skips and store the choice next to the model.", "calibrate"),
    "train": ("Train a drafter (an EAGLE-3 head, Medusa heads, or a distilled draft model) for a target "
              "on your own data.", "train"),
    "export": ("Write a folder another engine serves as it is: `export vllm` (target, drafter, "
               "speculative_config.json, serve.sh).", "export"),
    "demo": ("Run the default model pair on a few prompts: plain decoding against each method.", "demo"),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error of the CLI; the full usage is --help's."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser, every command's flags included; given the command line ``argv``, only the
    flags of the command it names, so that `specdecode --help` and each command import no other
    command's module (some take their flags' defaults from modules that import torch; importing
    every command's module takes about 4 s)."""
    parser = _Parser(
        prog="specdecode",
        description="Lossless speculative decoding: the target model's exact output, faster.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = next((a for a in argv if a in COMMANDS), None) if argv is not None else None
    for name, (help_text, module) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if argv is None or name == named:
            importlib.import_module(f"specdecode.cli.{module}").add_arguments(command)
    return parser


class _Stderr(logging.StreamHandler):
    """The message alone, on whatever ``sys.stderr`` is when it is emitted (a test's capture, a
    stream that tqdm wraps), not the one there was when the CLI started."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler's would fix the stream now

    @property
    def stream(self):  # noqa: ANN201 - whatever sys.stderr is
        return sys.stderr


def log_to_stderr() -> None:
    """Show the library's messages (INFO and up) on stderr, once however often ``main`` runs."""
    logger = logging.getLogger("specdecode")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
    logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    log_to_stderr()
    try:
        code = int(args.run(args) or 0)
        if damaged := WATCH.verify_now():  # weights found damaged after loading may have made the output
            print(f"specdecode: error: the cached weights {', '.join(p.name for p in damaged)} were damaged "
                  "while this command ran, so its output may be wrong; they were rebuilt: run it again",
                  file=sys.stderr)
            return 1
        return code
    except SpecDecodeError as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        if getattr(args, "json", False):  # --json promises one JSON object on stdout, errors included
            print(json.dumps({"error": {"type": type(exc).__name__, "message": str(exc)}}))
        return 2
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130
