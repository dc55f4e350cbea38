"""`dsforge` verbs from the command line (dsforge.commands and dsforge.cli)."""
