"""The README and the pages under docs/ hold to what they promise: a short front door without test names or commits,
links that resolve, the install CI runs, `vflash` command lines that parse, the CPU commands run as written, and a
help page for every node."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
# Pages for contributors, which may name tests and commits: the others are for users.
CONTRIBUTOR_PAGES = {ROOT / "docs" / "development.md", ROOT / "docs" / "architecture.md"}
USER_PAGES = [README, *(d for d in DOCS if d not in CONTRIBUTOR_PAGES)]
CPU_MARK = "<!-- cpu: runs in tests -->"
# A commit: 7 to 40 hex digits with at least one digit and one letter.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
TEST_NAME = re.compile(r"\btest_\w+")
# Sections benchmarks/report.py fills from the result files: each names the commit its figures were measured at.
GENERATED = re.compile(r"<!-- ([a-z0-9-]+): filled by benchmarks/report.py -->.*?<!-- /\1 -->", re.DOTALL)


def _bash_blocks(text: str) -> list[tuple[bool, str]]:
    """Each ```bash block: (marked as CPU-runnable, its text)."""
    return [(bool(mark), body) for mark, body in re.findall(r"(<!-- cpu: runs in tests -->\n)?```bash\n(.*?)```", text, re.DOTALL)]


def _commands(block: str) -> list[str]:
    """The block's command lines, continuation lines joined."""
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.encode()) <= 12 * 1024, f"README.md is {len(text.encode())} bytes"
    assert not TEST_NAME.search(text) and not COMMIT.search(text), (TEST_NAME.findall(text), COMMIT.findall(text))


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_name_no_test_and_no_commit(page):
    text = GENERATED.sub("", page.read_text())  # the generated figures keep their provenance
    assert not TEST_NAME.search(text), TEST_NAME.findall(text)
    assert not COMMIT.search(text), COMMIT.findall(text)


def test_the_checks_catch_what_they_look_for():
    assert COMMIT.findall("at `4bfd48d`, commit 481d129d11") == ["4bfd48d", "481d129d11"]
    assert not COMMIT.search("1344x768, 38,222 rows, sha256, t2va-base16-bf16-sm90, deadbeefcafe")
    assert TEST_NAME.findall("see tests/test_demo.py and test_a_thing") == ["test_demo", "test_a_thing"]
    assert _slug("Measured at full size (H200, torch 2.11)") == "measured-at-full-size-h200-torch-211"
    assert _slug("The user's model files: which node reads each") == "the-users-model-files-which-node-reads-each"


def test_every_relative_link_resolves():
    broken = []
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.MULTILINE)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_installs_what_ci_installs():
    """CI (`.ci/run`) runs the README's install and exactly its test command."""
    ci = (ROOT / ".ci" / "run").read_text()
    setup = _commands(_bash_blocks(README.read_text())[0][1])
    assert "vflash demo" in setup[1] and setup[-1].split("#")[0].strip() == "pytest -q", setup
    assert ci.strip().splitlines()[-1] == "pytest -q"
    torch_pins = set(re.findall(r"torch==[\d.]+", setup[1]))
    assert torch_pins and torch_pins == set(re.findall(r"torch==[\d.]+", ci)), (torch_pins, ci)
    assert 'pip install -e ".[test]"' in setup[1] and '-m pip install -q -e ".[test]"' in ci


def _documented_command_lines() -> list[tuple[str, list[str]]]:
    """Every `vflash ...` and `python -m vflash_core.weights.compiler ...` command of a bash block, as argv."""
    found = []
    for page in [README, *DOCS]:
        for _, block in _bash_blocks(page.read_text()):
            for line in (part.strip() for whole in _commands(block) for part in whole.split(" && ")):
                if not line.startswith(("vflash ", "python -m vflash_core.weights.compiler ")):
                    continue
                if "..." in line:  # an elided example ("vflash generate ... --gpu 0 --peer-gpu 1")
                    continue
                line = re.sub(r'"\$\(.*?\)"', "RECEIPT", line)  # a receipt path computed by a shell substitution
                line = line.replace("[", "").replace("]", "")  # optional flags: parse them too
                found.append((f"{page.relative_to(ROOT)}: {line}", shlex.split(line, comments=True)))
    return found


def test_documented_command_lines_parse():
    """A renamed or removed option, or a renamed command, fails here: each line goes through its own parser."""
    from vflash_core.cli.main import build_parser
    from vflash_core.weights import compiler

    lines = _documented_command_lines()
    assert {argv[1] for _, argv in lines if argv[0] == "vflash"} >= {"demo", "generate", "prepare-pipeline", "serve",
                                                                    "compare", "denoise", "run-workflow"}
    for where, argv in lines:
        parser, args = (compiler.build_parser(), argv[3:]) if argv[0] == "python" else (build_parser(argv[1]), argv[1:])
        if "--help" in args:
            continue
        try:
            parser.parse_args(args)
        except SystemExit as error:
            pytest.fail(f"{where} does not parse (exit {error.code})")
        for arg in args:
            if arg.startswith("workflows/"):
                assert (ROOT / arg).exists(), where


def test_the_cpu_commands_run_as_written(tmp_path):
    """The blocks marked CPU-runnable run in the repository root, each line as written."""
    lines = [(page, line) for page in [README, *DOCS] for marked, block in _bash_blocks(page.read_text()) if marked
             for line in _commands(block)]
    assert {page.name for page, _ in lines} >= {"README.md", "engine.md", "comfyui.md"}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "VFLASH_CACHE": str(tmp_path / "cache")}
    before = sorted(p.name for p in ROOT.iterdir())
    for page, line in lines:
        done = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip(), f"{page.name}: {line}\n{done.stdout}\n{done.stderr}"
    assert sorted(p.name for p in ROOT.iterdir()) == before  # nothing written into the checkout


def test_every_node_has_a_help_page(pack):
    """docs/nodes/<node id>.md: titled with the display name, naming every input and output; the README links it."""
    pages = {p.stem: p.read_text() for p in (ROOT / "docs" / "nodes").glob("*.md")}
    assert set(pages) == set(pack.nodes)
    readme = README.read_text()
    for node_id in pack.nodes:
        schema, page = pack.schema(node_id), pages[node_id]
        assert page.startswith(f"# {schema.display_name}\n") and f"`{node_id}`" in page, node_id
        for name in [i.id for i in schema.inputs] + [o.id for o in schema.outputs]:
            assert f"`{name}`" in page, f"{node_id}: {name} is not on its page"
        assert f"(docs/nodes/{node_id}.md)" in readme, node_id


def test_the_tests_the_contributor_pages_name_exist():
    """A test renamed or removed leaves no stale name on docs/development.md or docs/architecture.md."""
    defined = {m for f in (ROOT / "tests").rglob("*.py") for m in re.findall(r"^\s*def (test_\w+)", f.read_text(), re.MULTILINE)}
    for page in sorted(CONTRIBUTOR_PAGES):
        text = page.read_text()
        files = set(re.findall(r"\btests/[\w/]+\.py", text)) - {"tests/test_x.py"}  # test_x: the example of a file
        assert all((ROOT / f).exists() for f in files), [f for f in files if not (ROOT / f).exists()]
        names = set(re.findall(r"\b(test_\w+)(?![\w.])", text)) - {"test_x"}
        assert names <= defined, sorted(names - defined)
