"""Compressed collectives: lossy allreduces whose wire format is smaller than the tensor.

``compressed`` runs the allreduces of the methods in ddl_triton/compression_methods.py (the
registry: int8, 1-bit, fp16, bf16; int4's in ``int4``; the two-rank case gathered instead, in
``gathered``), over the slot layout ``layout`` gives; ``per_level`` keeps a host's ranks at full
precision over shared memory and compresses only between hosts, as the "ddl" process group does
with DDL_COMPRESSION. Compression sits above the call path and may import it, set-up and the
lanes; the communicator composes it.
"""
