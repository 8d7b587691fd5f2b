"""``python -m reshard``: the same command as ``reshard`` (for environments without the script)."""

from reshard.entry import main

main()
