"""`python -m trainwise` is the `trainwise` command."""

from trainwise.cli.main import command

command()
