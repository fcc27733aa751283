import os

# The Triton kernels run on CPU tensors only through the interpreter, and triton reads this
# when it is first imported: set it before any test module imports ddl_triton (and triton).
os.environ["TRITON_INTERPRET"] = "1"
