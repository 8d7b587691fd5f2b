"""One module per ``reshard`` command: each adds its subparser (``add``) and runs it (``run``).

A command module builds its flag groups' options (``reshard.cli.flags``,
``reshard.cli.tensor_flags``), calls the operation through ``reshard.cli.calls`` and prints through
``reshard.cli.report``. ``reshard.cli.parser.COMMANDS`` lists them in the order of the help.
"""

__all__: list[str] = []
