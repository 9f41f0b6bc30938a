"""Every ```python block of README.md and docs/*.md runs as written, in a fresh Python process.

A block is a whole program: its own imports, the 8 virtual CPU devices a mesh needs set by the
block itself, and asserts (or prints) of what it computes, so a reader can paste it as it is.
What cannot run on a CPU (a multi-process launch, a kernel sketch) belongs in a ```bash or
plain fence. A block that does not run fails here, named by its file and index (README's by
default, those of docs/*.md with `-m slow`; every block's imports by default). Also: the
backend names of the code, docs/SPEC.md, README.md and docs/backends.md agree.
"""

import ast
import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A fence of its own line, indented or not (inside a list item), up to the closing fence.
BLOCK = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
TIMEOUT_S = 300  # each block takes seconds; this only stops a hang
# README's blocks run by default; those of docs/*.md, each a twin of tests of the same calls
# (backends.md's of test_backends, decoding.md's of test_decode and test_layer_decode,
# layer.md's of test_nn and test_packed, ring.md's of test_ring and test_tensor_parallel), with
# `-m slow` (~75 s of CPU), and every block's imports are checked by default
# (test_block_parses_and_its_imports_exist).
RUN_BY_DEFAULT = ("README.md",)


def blocks():
  """A `pytest.param(file, line, code)` per python block, its id `file:index`."""
  for path in FILES:
    rel = path.relative_to(ROOT).as_posix()
    text = path.read_text(encoding="utf-8")
    for i, match in enumerate(BLOCK.finditer(text)):
      line = text.count("\n", 0, match.start()) + 1
      code = textwrap.dedent(match.group(2))
      yield pytest.param(rel, line, code, id=f"{rel}:{i}",
                         marks=() if rel in RUN_BY_DEFAULT else pytest.mark.slow)


BLOCKS = list(blocks())


def test_blocks_found():
  """README keeps its three examples."""
  assert sum(p.values[0] == "README.md" for p in BLOCKS) >= 3


def test_backend_names_agree():
  """The backends the code knows are those docs/SPEC.md names and README's and
  docs/backends.md's tables list, no more, no fewer."""
  from hilbert_ring_jax.backends import NAMES  # pylint: disable=g-import-not-at-top
  row = re.compile(r"^\| `(\w+)` \|", re.M)
  for rel in ("README.md", "docs/backends.md"):
    text = (ROOT / rel).read_text(encoding="utf-8")
    table = text[text.index("| name |"):]
    table = table[:table.index("\n\n")]
    assert set(row.findall(table)) == set(NAMES), rel
  spec = (ROOT / "docs/SPEC.md").read_text(encoding="utf-8")
  named = set(re.findall(r"`(\w+)`", spec)) & {"xla", "pallas", "triton", "mosaic", "cudnn",
                                                   "tokamax", "jax_triton"}
  assert named == set(NAMES), named


@pytest.mark.parametrize("rel, line, code", [pytest.param(*p.values, id=p.id) for p in BLOCKS])
def test_block_parses_and_its_imports_exist(rel, line, code):
  """Every block is Python, and every module and name it imports exists (a renamed or
  removed name fails here, where its block only runs with `-m slow`)."""
  tree = ast.parse(code, filename=f"{rel}, the block at line {line}")
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        importlib.import_module(alias.name)
    elif isinstance(node, ast.ImportFrom):
      module = importlib.import_module(node.module)
      for alias in node.names:
        assert hasattr(module, alias.name) or importlib.util.find_spec(
            f"{node.module}.{alias.name}"), f"{rel}:{line}: {node.module}.{alias.name}"


@pytest.mark.parametrize("rel, line, code", BLOCKS)
def test_block_runs(rel, line, code):
  env = dict(os.environ, JAX_PLATFORMS="cpu")  # the blocks are written for a CPU machine
  try:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT_S, check=False)
  except subprocess.TimeoutExpired as e:
    stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
    pytest.fail(f"{rel}, the block at line {line}, ran over {TIMEOUT_S} s:\n{stderr or ''}")
  assert result.returncode == 0, (
      f"{rel}, the block at line {line}, exited with {result.returncode}\n"
      f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-8000:]}")
