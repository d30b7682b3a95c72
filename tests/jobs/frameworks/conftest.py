"""The job scripts here run in .venv-jobs/frameworks (.ci/jobenvs.sh), where the
frameworks are: pytest's doctest collection must not import them."""

collect_ignore_glob = ["*.py"]
