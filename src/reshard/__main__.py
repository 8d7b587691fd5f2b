"""``python -m reshard``: the same command as ``reshard`` (for environments without the script)."""

import sys

from reshard.cli import main

sys.exit(main())
