"""What the tests share: launching ranks under a time limit, whole-line reports, sentinel fills and
the host stand-ins for nvshmem and CUDA."""
