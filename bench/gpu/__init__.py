"""The GPU check: prepared where the package registries answer, run on a GPU machine (README.md here)."""
