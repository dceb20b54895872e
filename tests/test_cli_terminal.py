"""What a terminal shows of `smc-sd generate`: the streamed answer whole, never overwritten by the
progress line. The command runs under a pseudo-terminal and its output is rendered as a terminal
would render it."""

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from smc_sd.cli import progress_can_be_live

QUESTION = "What is the capital of France?"
# the bare command of the README and docs/cli.md
BARE_COMMAND = [sys.executable, "-m", "smc_sd.cli", "generate", QUESTION]


def render(output: bytes) -> list[str]:
    """The lines a terminal shows after printing `output` (no line wrapping).

    Printable characters overwrite the screen at the cursor; "\\r" returns the cursor to column 0;
    "\\n" moves it one line down in the same column (a terminal's line feed: the pseudo-terminal
    sends "\\r\\n" for a program's "\\n"); "ESC [ K" erases from the cursor to the end of the line.
    Any other control sequence fails the test, so nothing unrendered can pass unseen.
    """
    screen: list[list[str]] = [[]]
    row = column = 0
    text = output.decode("utf-8")
    i = 0
    while i < len(text):
        if text.startswith("\x1b[K", i):
            del screen[row][column:]
            i += 3
            continue
        char = text[i]
        i += 1
        if char == "\r":
            column = 0
        elif char == "\n":
            row += 1
            if row == len(screen):
                screen.append([])
        elif char.isprintable():
            line = screen[row]
            line.extend(" " * (column + 1 - len(line)))
            line[column] = char
            column += 1
        else:
            raise AssertionError(f"the renderer does not know the control character {char!r}")
    return ["".join(line).rstrip() for line in screen]


def run_on_terminal(argv: list[str], stdout=None, timeout: float = 300.0) -> tuple[int, bytes]:
    """Run `argv` with stderr on a pseudo-terminal (and stdout on it too, unless `stdout` is given).

    Returns:
        (exit status, every byte the terminal received).
    """
    primary, secondary = pty.openpty()
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=secondary if stdout is None else stdout,
                               stderr=secondary, env={**os.environ, "TERM": "xterm"})
    os.close(secondary)
    received = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(primary, 4096)
            except OSError:
                # EIO: the program has closed the terminal's last open end
                break
            if not chunk:
                break
            received += chunk
        else:
            raise AssertionError(f"{argv} ran past {timeout} s")
        return process.wait(timeout=30), bytes(received)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(primary)


def test_renderer_overwrites_as_a_terminal_does():
    # the screen the unfixed command left: the progress line written over the answer
    assert render(b"The capital\r[7 tokens, 13 tok/s]") == ["[7 tokens, 13 tok/s]"]
    assert render(b"abcdef\r\x1b[Kxy\r\nz") == ["xy", "z"]
    assert render(b"abc\ndef") == ["abc", "   def"]


def test_progress_is_live_only_on_a_terminal_stdout_does_not_share(tmp_path):
    primary, secondary = pty.openpty()
    try:
        with open(secondary, "w", closefd=False) as terminal, open(tmp_path / "out", "w") as file:
            assert progress_can_be_live(out=file, err=terminal)
            # one terminal for both: a carriage return would land in the answer
            assert not progress_can_be_live(out=terminal, err=terminal)
            # stderr a file: no redrawn lines in it
            assert not progress_can_be_live(out=terminal, err=file)
    finally:
        os.close(secondary)
        os.close(primary)


@pytest.mark.model
def test_bare_command_leaves_the_whole_answer_on_the_terminal(tmp_path):
    # stdout to a file, stderr on the terminal: the answer as a file receives it, and the progress
    # line is drawn (and finally replaced by the summary)
    with open(tmp_path / "answer", "wb") as answer_file:
        code, progress = run_on_terminal(BARE_COMMAND, stdout=answer_file)
    assert code == 0
    answer = (tmp_path / "answer").read_text().rstrip("\n")
    assert answer.strip()
    assert b"tok/s]\r\x1b[K[" in progress
    # (a first run also says, on a line of its own, that it converts the model once)
    shown = [line for line in render(progress) if line and not line.startswith("smc-sd: converting")]
    assert len(shown) == 1 and shown[0].startswith("[") and " tokens in " in shown[0], shown

    # both on one terminal, as a user types the command: the answer stays whole, the summary below
    code, output = run_on_terminal(BARE_COMMAND)
    assert code == 0
    screen = [line for line in render(output) if not line.startswith("smc-sd: converting")]
    lines = [line.rstrip() for line in answer.splitlines()]
    assert screen[: len(lines)] == lines, screen
    assert screen[len(lines)].startswith("[") and " tokens in " in screen[len(lines)], screen
