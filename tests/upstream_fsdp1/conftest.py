# PyTorch's FSDP1 tests in this folder need the patches that run.py sets up (see README.md);
# the project's default `pytest` run does not collect them. run.py runs them with --noconftest.
collect_ignore_glob = ["test_*.py"]
