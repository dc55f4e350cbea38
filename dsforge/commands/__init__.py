"""One module per `dsforge` verb: what each command does behind its click declaration in dsforge.cli.

A command may import the compiler and, inside its functions, the runtime; the compiler imports no command.
"""

EXIT_CLEAN, EXIT_FINDINGS, EXIT_UNUSABLE = 0, 1, 2
