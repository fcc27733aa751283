"""Runnable examples, each a script first (``python examples/train_cnn.py``, ``make demo``) and,
installed as ``ddl_triton.examples``, a module too: the tests and benchmarks import train_cnn's CNN,
data and training loop from here instead of keeping a copy. Nothing here is imported by the package.
"""
