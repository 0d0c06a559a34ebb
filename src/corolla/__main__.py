"""`python -m corolla` is the `corolla` command."""

from corolla.cli.main import main

main()
