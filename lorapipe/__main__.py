"""`python -m lorapipe ...`: the `lorapipe` command."""
import sys

from lorapipe.flows.cli import main

sys.exit(main())
