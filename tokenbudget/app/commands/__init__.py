"""One module per command of the application, each with ``add_arguments(parser)``
and ``main(args) -> int`` (the exit code); :mod:`tokenbudget.cli` imports only the
one the command line names."""
