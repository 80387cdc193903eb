# Put on PYTHONPATH by tests/upstream_fsdp1/run.py only: patches every Python process of a run
# (the pytest process and each rank the tests spawn) before any test module is imported.
import os

if os.environ.get("UPSTREAM_FSDP1_IMPL"):
    import upstream_fsdp1_shim

    upstream_fsdp1_shim.install()
