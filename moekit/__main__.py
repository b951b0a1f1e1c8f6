"""`python -m moekit`: the `moekit` command line."""

import sys

from moekit.cli import main

sys.exit(main())
