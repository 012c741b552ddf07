"""Every code block of README.md runs, so the README cannot drift from the code.

The convention, for whoever edits README.md:

- Every ```` ```python ```` (or ```` ```py ````) block is run on its own, as a script, in a
  fresh temporary directory, with this checkout importable, by the interpreter running the
  tests; it must exit 0 within 60 s (blocks do not share state: each one has its imports).
  Its process is forked from an interpreter that has imported torch and offload and run
  nothing else (tests/_forkserver.py), which saves each block that import.
- A ```` ```bash ```` (or ```` ```sh ````/```` ```shell ````) block is run only when the line
  just before its opening fence is a test marker, ``<!-- test -->``. It runs with
  ``bash -e -o pipefail`` in a fresh temporary directory, with the tests' virtual
  environment first on ``PATH`` (so ``offload`` and ``python`` are this checkout's) and
  ``$REPO`` set to the repository root. Unmarked bash blocks (``make demo``, ``make test``,
  installs) are documentation only.
- The marker takes options, comma-separated: ``<!-- test: timeout=180 -->`` (seconds),
  ``<!-- test: torchrun=2 -->`` (a python block run under ``python -m torch.distributed.run
  --standalone --nproc_per_node 2``), ``<!-- test: cwd=repo -->`` (run in the repository
  root instead of a temporary directory), ``<!-- test: skip=needs a CUDA device -->`` (not
  run; the reason is reported as the skip reason). An unknown option, or a marker before a
  block of another language, fails the suite rather than silently testing less.

Keep README blocks fast (a few seconds each): the whole suite has a time budget.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Dict, List

import pytest

import _forkserver as forkserver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DEFAULT_TIMEOUT = 60
PYTHON_LANGS = ("python", "py")
BASH_LANGS = ("bash", "sh", "shell")
_MARKER = re.compile(r"^\s*<!--\s*test\s*(?::\s*(?P<opts>.*?))?\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_KNOWN_OPTS = {"timeout", "torchrun", "cwd", "skip"}


@dataclass
class Block:
    lang: str
    line: int
    """1-based line of the opening fence."""
    code: str
    marked: bool = False
    opts: Dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.lang}-line{self.line}"


def parse_marker(text: str, where: str) -> Dict[str, str]:
    opts: Dict[str, str] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key not in _KNOWN_OPTS:
            raise ValueError(f"{where}: unknown test-marker option {key!r} (known: {', '.join(sorted(_KNOWN_OPTS))})")
        opts[key] = value
    if "timeout" in opts and not opts["timeout"].isdigit():
        raise ValueError(f"{where}: timeout must be whole seconds, got {opts['timeout']!r}")
    if "torchrun" in opts and not opts["torchrun"].isdigit():
        raise ValueError(f"{where}: torchrun must be a number of processes, got {opts['torchrun']!r}")
    if "cwd" in opts and opts["cwd"] != "repo":
        raise ValueError(f"{where}: cwd can only be 'repo', got {opts['cwd']!r}")
    return opts


def extract_blocks(markdown: str, name: str = "README.md") -> List[Block]:
    """The fenced code blocks of ``markdown`` with their test markers (see the module doc)."""
    lines = markdown.splitlines()
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group("fence"), m.group("lang").lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        if i >= len(lines):
            raise ValueError(f"{name}:{start + 1}: code block never closed")
        i += 1  # past the closing fence
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1  # a blank line between marker and fence is allowed
        marker = _MARKER.match(lines[prev]) if prev >= 0 and prev >= start - 2 else None
        block = Block(lang=lang, line=start + 1, code=textwrap.dedent("\n".join(body)) + "\n")
        if marker:
            where = f"{name}:{prev + 1}"
            if lang not in PYTHON_LANGS + BASH_LANGS:
                raise ValueError(f"{where}: test marker before a {lang or 'plain'} block (only python and bash blocks run)")
            block.marked, block.opts = True, parse_marker(marker.group("opts"), where)
            if "torchrun" in block.opts and lang not in PYTHON_LANGS:
                raise ValueError(f"{where}: torchrun= applies to python blocks only")
        blocks.append(block)
    return blocks


def runnable(blocks: List[Block]) -> List[Block]:
    return [b for b in blocks if b.lang in PYTHON_LANGS or (b.lang in BASH_LANGS and b.marked)]


def _readme_blocks() -> List[Block]:
    if not os.path.exists(README):
        return []
    with open(README, encoding="utf-8") as fh:
        return extract_blocks(fh.read())


_BLOCKS = runnable(_readme_blocks())


@pytest.mark.parametrize("block", _BLOCKS, ids=[b.id for b in _BLOCKS])
def test_readme_block_runs(block: Block, tmp_path):
    if "skip" in block.opts:
        pytest.skip(f"README.md:{block.line}: {block.opts['skip'] or 'marked skip'}")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["REPO"] = REPO
    env.setdefault("OMP_NUM_THREADS", "1")  # blocks are tiny; no thread fights on 2 cores
    cwd = REPO if block.opts.get("cwd") == "repo" else str(tmp_path)
    if block.lang in PYTHON_LANGS:
        script = tmp_path / f"readme_{block.line}.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
        if "torchrun" in block.opts:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", block.opts["torchrun"], str(script)]
    else:
        script = tmp_path / f"readme_{block.line}.sh"
        script.write_text(block.code)
        cmd = ["bash", "-e", "-o", "pipefail", str(script)]
    timeout = int(block.opts.get("timeout", DEFAULT_TIMEOUT))
    try:
        if cmd[:2] == [sys.executable, str(script)]:  # forked from a warm interpreter (~2 s less)
            proc = forkserver.run(str(script), env=env, cwd=cwd, timeout=timeout)
        else:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"README.md:{block.line} ({block.lang}) ran past {timeout} s:\n{block.code}\n"
                    f"--- output ---\n{(exc.stdout or b'')[-2000:]!r}")
    assert proc.returncode == 0, (
        f"README.md:{block.line} ({block.lang}) exited {proc.returncode}:\n{block.code}\n"
        f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )


def test_readme_has_python_examples():
    if not os.path.exists(README):
        pytest.skip("no README.md yet")
    assert any(b.lang in PYTHON_LANGS for b in _readme_blocks()), "README.md has no python example to run"


# ----------------------------------------------------------------------------- the harness itself
_SAMPLE = """\
# t

```bash
make test
```

<!-- test -->
```bash
offload info
```

```python
print("a")
```

<!-- test: timeout=5, torchrun=2 -->

```py
print("b")
```

<!-- test: skip=needs CUDA -->
```python
import torch; torch.zeros(1, device="cuda")
```

```text
not code
```
"""


def test_extract_blocks_follows_the_convention():
    blocks = extract_blocks(_SAMPLE)
    assert [(b.lang, b.line, b.marked) for b in blocks] == [
        ("bash", 3, False), ("bash", 8, True), ("python", 12, False), ("py", 18, True),
        ("python", 23, True), ("text", 27, False)]
    run = runnable(blocks)
    assert [b.line for b in run] == [8, 12, 18, 23]  # unmarked bash and text blocks do not run
    assert run[0].code == "offload info\n"
    assert run[2].opts == {"timeout": "5", "torchrun": "2"}
    assert run[3].opts == {"skip": "needs CUDA"}


@pytest.mark.parametrize("bad", [
    "<!-- test: tiemout=5 -->\n```python\npass\n```\n",       # typo: not silently ignored
    "<!-- test -->\n```text\nx\n```\n",                        # marker on a block that cannot run
    "<!-- test: torchrun=2 -->\n```bash\ntrue\n```\n",         # torchrun is for python blocks
    "<!-- test: timeout=soon -->\n```python\npass\n```\n",
    "```python\npass\n",                                       # unclosed fence
])
def test_extract_blocks_rejects_bad_markers(bad):
    with pytest.raises(ValueError):
        extract_blocks(bad)
