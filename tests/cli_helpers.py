"""Running a command-line entry point in-process, as the tests of the training CLI do."""


def run_cli(main, capsys, *argv):
    """(exit code, the ``error:`` lines of stderr, stderr + stdout) of ``main(list(argv))``."""
    code = main(list(argv))
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    return code, errors, captured.err + captured.out
