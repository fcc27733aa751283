"""What the tests share: launching ranks under a time limit, whole-line reports, the multi-rank
workers' checker, sentinel fills and the host stand-ins for nvshmem and CUDA. The suite's
processes find this package through PYTHONPATH (tests/conftest.py sets it), not sys.path edits."""
