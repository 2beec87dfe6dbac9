"""Every code block a user would run in README.md and docs/*.md is run by a test, and the README stays what it
promises (short, its support matrix generated from the code, its links and the docs' links resolving).

A block is tagged by an HTML comment on the line right before its opening fence:

    <!-- not run: REASON -->                         skipped, with REASON (it must say one)
    <!-- run by: tests/test_x.py::test_name -->      another test runs it (several: comma-separated); each test
                                                     function must exist (the file is parsed, not imported)

Untagged blocks are run here:

- ```python: in a fresh interpreter (this one's), its working directory a temporary one in which `configs/`,
  `docs/` and `examples/` link to the repository's;
- ```bash, ```console and unlabelled blocks of `$ ` lines: each command that starts with `trl-distill`, `python` or
  `accelerate launch`, in such a directory too (`trl-distill plan` is called in this process: it only reads
  configs). Where a transcript shows a command's output after its `$ ` line, those lines must appear, in order, in
  what the command prints now.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support_matrix_doc import block as matrix_block  # tests/ is on sys.path
from support_matrix_doc import render

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150
SHELL = {"bash", "sh", "shell", "console"}
RUNNABLE = ("trl-distill", "python", "accelerate launch")
LINKED = ("configs", "docs", "examples")
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
TAG = re.compile(r"^<!--\s*(not run|run by):(.*?)-->\s*$", re.S)


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: list[str]
    tag: tuple[str, str] | None  # ("not run" | "run by", the rest)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def transcript(self) -> bool:
        return any(line.startswith("$ ") for line in self.body)

    @property
    def kind(self) -> str | None:
        """'python', 'shell', or None for a block nobody runs (a diagram, an output, a config)."""
        if self.lang == "python":
            return "python"
        if self.lang in SHELL or (not self.lang and self.transcript):
            return "shell"
        return None


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, start = match.group(1), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence[0] * len(fence))), len(lines))
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        tag = TAG.match(before)
        if tag is None and re.match(r"^<!--\s*(not run|run by)\b", before):
            raise AssertionError(f"{page.name}:{start + 1}: malformed tag {before!r}")
        found.append(Block(page, start + 1, match.group(2).lower(), lines[start + 1:end],
                           (tag.group(1), tag.group(2).strip()) if tag else None))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page) if b.kind]
TAGGED = [b for b in ALL if b.tag]
PYTHON = [b for b in ALL if not b.tag and b.kind == "python"]


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """``(command, the output the block shows after it)`` for each runnable command of a shell block."""
    out: list[tuple[str, list[str]]] = []
    lines = iter(block.body)
    for line in lines:
        if block.transcript and not line.startswith("$ "):
            if out:
                out[-1][1].append(line)
            continue
        command = line[2:] if line.startswith("$ ") else line
        while command.rstrip().endswith("\\"):
            command = command.rstrip()[:-1] + " " + next(lines, "").strip()
        command = command.strip()
        if command.startswith(RUNNABLE):
            out.append((command, []))
        elif block.transcript:
            out.append(("", []))  # a command nobody runs here: its output is not checked
    return [(command, [o for o in shown if o.strip()]) for command, shown in out if command]


SHELL_RUN = [b for b in ALL if not b.tag and b.kind == "shell" and commands(b)]


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A temporary working directory in which the repository's configs/, docs/ and examples/ are at hand."""
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def function_exists(reference: str) -> bool:
    """`tests/test_x.py::test_name` or `tests/test_x.py::TestClass::test_name` (a parametrization id ignored)."""
    path, *names = reference.split("::")
    file = ROOT / path
    if not names or not file.is_file():
        return False
    scope = ast.parse(file.read_text()).body
    for name in (n.split("[", 1)[0] for n in names):
        node = next((n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                     and n.name == name), None)
        if node is None:
            return False
        scope = node.body
    return True


@pytest.mark.parametrize("block", TAGGED, ids=lambda b: b.id)
def test_a_tagged_block_says_why_or_names_the_test_that_runs_it(block):
    kind, rest = block.tag
    assert rest, f"{block.id}: `<!-- {kind}: -->` needs a reason or a test"
    if kind == "run by":
        for reference in (r.strip() for r in rest.split(",")):
            assert function_exists(reference), f"{block.id}: no test {reference}"


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_a_python_block_runs(block, workdir):
    script = workdir / "block.py"
    script.write_text("\n".join(block.body) + "\n")
    result = subprocess.run([sys.executable, str(script)], cwd=workdir, env=environment(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def run_command(command: str, cwd: Path) -> str:
    if command.startswith("trl-distill plan"):
        from trl_distill.cli import main

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                main(shlex.split(command)[1:])
            except SystemExit as exit_:
                assert exit_.code in (None, 0), f"{command}: exit {exit_.code}\n{printed.getvalue()}"
        return printed.getvalue()
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=environment(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.parametrize("block", SHELL_RUN, ids=lambda b: b.id)
def test_a_shell_block_runs_and_prints_what_it_shows(block, workdir):
    for command, shown in commands(block):
        printed = [line.rstrip() for line in run_command(command, workdir).splitlines()]
        position = 0
        for line in shown:
            try:
                position = printed.index(line.rstrip(), position) + 1
            except ValueError:
                pytest.fail(f"{block.id}: `{command}` no longer prints (in this order) {line!r}")


def test_the_pages_hold_blocks_of_each_kind():
    """A guard on the parsing above: it finds blocks run here, shell commands run here and tagged blocks."""
    assert PYTHON and SHELL_RUN and TAGGED
    assert any(b.page.name == "README.md" and b.kind == "python" for b in TAGGED)  # the minimal example


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_the_readme_support_matrix_is_generated_from_the_code():
    from trl_distill.teacher import support_matrix

    shown = matrix_block((ROOT / "README.md").read_text())
    assert shown == render(support_matrix()).strip(), (
        "the README's support matrix differs from trl_distill.teacher.support_matrix(): "
        "run `python tests/support_matrix_doc.py` to rewrite it")


def test_render_numbers_each_distinct_message_once():
    table = render({"a": {"x": "yes", "y": "refused: no | never"}, "b": {"x": "refused: no | never", "y": "yes"}})
    assert table.splitlines() == ["| teacher | x | y |", "|---|---|---|", "| a | yes | refused¹ |",
                                  "| b | refused¹ | yes |", "", "1. no | never"]
    with pytest.raises(ValueError):
        render({"a": {"x": "maybe"}})


def test_the_readme_minimal_example_keeps_what_the_out_of_the_box_test_swaps():
    """tests/test_out_of_the_box.py runs the first python block after `## Minimal example`, swapping these."""
    section = (ROOT / "README.md").read_text().split("## Minimal example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for name in ('"Qwen/Qwen3-0.6B"', '"Qwen/Qwen3-8B"', '"trl-lib/Capybara"', '"qwen-distilled"'):
        assert code.count(name) == 1, name
    compile(code, "README.md", "exec")


def test_each_results_block_of_the_benchmarks_stands_in_one_page():
    """The markers between which the benchmark scripts write their tables: each pair once, in one page."""
    sources = "\n".join(p.read_text() for p in (ROOT / "benchmarks").rglob("*.py"))
    names = sorted(set(re.findall(r"<!-- ([\w:-]+):start -->", sources)))
    assert names
    for name in names:
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        holders = [p for p in PAGES if start in p.read_text() or end in p.read_text()]
        assert len(holders) == 1, f"{start}: in {[p.name for p in holders]}"
        text = holders[0].read_text()
        assert text.count(start) == text.count(end) == 1 and text.index(start) < text.index(end), name


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target}: no {file}"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: link to {target}: no such heading"
