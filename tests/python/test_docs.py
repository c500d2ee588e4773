"""The documents' tables hold measurements: a benchmark's progress bar (tqdm writes it to stderr) once
replaced a whole table of BENCHMARKS.md when a run's output was pasted with its stderr."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROGRESS_BAR = re.compile(r"\d+/\d+ \[\d+:\d+<|[▏▎▍▌▋▊▉█]{2,}|\d+%\|")


@pytest.mark.parametrize("name", ["README.md", "BENCHMARKS.md"])
def test_no_progress_bar_in_the_documents(name):
    text = (ROOT / name).read_text(encoding="utf-8")
    pasted = [f"{name}:{number}: {line}" for number, line in enumerate(text.splitlines(), 1)
              if PROGRESS_BAR.search(line)]
    assert not pasted, "progress output pasted into the document:\n" + "\n".join(pasted[:5])


def test_the_check_finds_a_pasted_progress_bar():
    line = "| wgrad into fp32 main_grad:  14% | █▍ | 3/21 [00:01<00:08,  2.23shape/s] |"
    assert PROGRESS_BAR.search(line)
