"""The install as a user meets it: `import tokenmill` works from any folder, also one that holds another folder
named tokenmill (a clone's parent: with an editable install's import hook, such a folder won as a namespace
package; the src layout puts the package on sys.path instead)."""

import subprocess
import sys
from pathlib import Path


def test_tokenmill_imports_beside_a_folder_of_the_same_name(tmp_path: Path) -> None:
    (tmp_path / "tokenmill").mkdir()  # as the clone's own folder, seen from its parent
    out = subprocess.run(
        [sys.executable, "-c", "from tokenmill import LLM, SamplingParams; print(LLM.__module__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "tokenmill.entrypoints.llm"
