"""The shell commands of the project's Markdown pages, read as a reader copies them, and a sandbox that runs them.

A command is one step of a shell line in a fenced ``bash`` / ``sh`` / ``shell`` / ``console`` block: ``\\``
continuation lines are joined, a ``#`` comment outside quotes is dropped, an ``&&`` chain is cut into its steps,
and a trailing ``&`` marks a step that runs in the background. In a ``console`` block only the lines after a
``$`` prompt are commands; the rest is output.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
CHECKOUT_LINKS = ("yaml_configs", "tools", "examples", "leangrpo_mcore")
"""What the sandbox links from the checkout: the docs' paths are relative to a checkout's root."""


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    language: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str
    background: bool = False
    block: int = 0
    """The line of the fenced block it is in: a command may use what the earlier ones of its block wrote."""

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def fenced_blocks(text: str, doc: str) -> list[Block]:
    """Every fenced code block of a Markdown text, with the language named after its opening fence ('' if none)."""
    blocks, current, start, language = [], None, 0, ""
    for number, line in enumerate(text.splitlines(), 1):
        fence = line.strip()
        if not fence.startswith("```"):
            if current is not None:
                current.append(line)
            continue
        if current is None:
            current, start, language = [], number, fence[3:].strip().split(" ")[0]
        else:
            blocks.append(Block(doc, start, language, tuple(current)))
            current = None
    return blocks


def file_blocks(text: str, doc: str) -> dict[str, str]:
    """The blocks a page asks the reader to save: those whose first line is a comment naming a file
    (``# my_rewards.py``), by file name."""
    out = {}
    for block in fenced_blocks(text, doc):
        match = re.fullmatch(r"(?:#|//) ([\w.-]+\.\w+)", block.lines[0].strip()) if block.lines else None
        if match:
            out[match.group(1)] = "\n".join(block.lines) + "\n"
    return out


def _outside_quotes(text: str):
    """(index, char, outside) for each character: outside is False inside '...' or "..." (backslash-escaped
    characters count as quoted)."""
    quote, escaped = None, False
    for index, char in enumerate(text):
        outside = quote is None and not escaped
        yield index, char, outside
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote is None and char in "'\"":
            quote = char
        elif char == quote:
            quote = None


def strip_comment(line: str) -> str:
    """The line without a ``#`` comment (one that starts a word outside quotes)."""
    for index, char, outside in _outside_quotes(line):
        if outside and char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def split_steps(line: str) -> list[tuple[str, bool]]:
    """The steps of an ``&&`` chain, each with whether it runs in the background (a trailing single ``&``)."""
    steps, start, skip = [], 0, False
    for index, char, outside in _outside_quotes(line):
        if skip:
            skip = False
            continue
        if outside and line.startswith("&&", index):
            steps.append(line[start:index])
            start, skip = index + 2, True
    steps.append(line[start:])
    out = []
    for step in (s.strip() for s in steps):
        background = step.endswith("&") and not step.endswith("\\&")
        out.append((step[:-1].strip() if background else step, background))
    return [(s, b) for s, b in out if s]


def _logical_lines(block: Block) -> list[tuple[int, str]]:
    """(line number, text) of each shell line of a block, continuations joined and comments dropped."""
    lines, pending, first = [], None, 0
    console = block.language == "console"
    for offset, raw in enumerate(block.lines, block.line + 1):
        text = raw.strip()
        if pending is None:
            if console:
                if not text.startswith("$ "):
                    continue
                text = text[2:]
            if not strip_comment(text):
                continue
            first, pending = offset, ""
        text = strip_comment(text)
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        lines.append((first, (pending + text).strip()))
        pending = None
    return lines


def commands_of(text: str, doc: str) -> list[Command]:
    """The commands of a Markdown text's shell blocks, in order."""
    out = []
    for block in fenced_blocks(text, doc):
        if block.language not in SHELL_LANGUAGES:
            continue
        for line, logical in _logical_lines(block):
            out += [Command(doc, line, step, background, block.line) for step, background in split_steps(logical)]
    return out


def words(command: str) -> list[str]:
    """The command's words as the shell splits them (no expansion)."""
    return shlex.split(command)


def program_words(command: str) -> list[str]:
    """The words from the program on: leading ``NAME=value`` environment assignments dropped."""
    argv = words(command)
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        argv = argv[1:]
    return argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the background command never listened on port {port} (exit {process.poll()})")


class Sandbox:
    """A fresh directory laid out as a checkout (links to its ``CHECKOUT_LINKS``) where commands run as written,
    through bash, with the interpreter's environment first on ``PATH`` and the checkout on ``PYTHONPATH``."""

    def __init__(self, path: Path, checkout: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        for name in CHECKOUT_LINKS:
            (path / name).symlink_to(checkout / name, target_is_directory=True)
        python_path = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                    "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.background: list[subprocess.Popen] = []

    def run(self, command: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=self.path, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def start(self, command: str, timeout: float) -> None:
        """Start a background command; one that names ``--port P`` is waited for until P accepts connections."""
        process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.path, env=self.env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.background.append(process)
        argv = program_words(command)
        if "--port" in argv:
            _wait_for_port(int(argv[argv.index("--port") + 1]), process, timeout)

    def close(self) -> None:
        for process in self.background:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def produced_paths(command: str) -> list[str]:
    """The files or folders a command names as its outputs: the values of ``--out``, ``--dst``, ``--markdown``,
    ``--plot`` (and ``--json`` where it takes a path), and ``train.output_dir``'s ``metrics.jsonl``."""
    argv, paths = program_words(command), []
    for flag in ("--out", "--dst", "--markdown", "--plot", "--json"):
        if flag in argv[:-1]:
            value = argv[argv.index(flag) + 1]
            if not value.startswith("-") and (flag != "--json" or value.endswith(".json")):
                paths.append(value)
    for word in argv:
        if word.startswith("train.output_dir="):
            paths.append(word.split("=", 1)[1] + "/metrics.jsonl")
    return paths


def override_words(command: str) -> list[str]:
    """The command's ``dotted.key=value`` config overrides."""
    return [w for w in program_words(command) if re.match(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+)+=", w)]


def config_word(command: str) -> Optional[str]:
    """The YAML config a command names under ``yaml_configs/`` (the first one), if any."""
    return next((w for w in program_words(command) if w.startswith("yaml_configs/") and w.endswith(".yaml")), None)
