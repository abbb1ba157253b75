"""`python -m trainwise` is the `trainwise` command."""

import sys

from trainwise.cli.main import main

sys.exit(main())
