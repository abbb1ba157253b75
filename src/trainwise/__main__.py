"""`python -m trainwise` is the `trainwise` command."""

from trainwise.cli.main import main
from trainwise.process_exit import exit_process

exit_process(main())
