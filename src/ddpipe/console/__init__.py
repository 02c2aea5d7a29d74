"""The ``ddpipe`` command (``subcommands``): the top of the house, above every package whose command it runs; nothing
imports it."""
