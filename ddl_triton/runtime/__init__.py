"""ddl_triton.runtime."""
