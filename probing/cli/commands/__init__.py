"""What each ``probing`` command does once its options are read.

``probing.cli.app`` parses the command line and registers every command; the
work of the longer ones lives here, one module each: ``query`` (``query``,
``tables``), ``trace``, ``diagnose`` and ``ui``. They print with
``typer.echo``, raise ``ProbingError`` for the CLI to turn into one line on
stderr, and return the exit status where it is not 0 or 1. Heavy modules
(pyarrow, datafusion, bcc) are imported inside the functions that need them.
"""
