"""ddl_triton.launch."""
