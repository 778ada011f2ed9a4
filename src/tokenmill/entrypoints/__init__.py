"""User-facing entry points: the offline `LLM` class and the `tokenmill` command line, with its bench commands
(bench/: on LLM and over HTTP)."""
