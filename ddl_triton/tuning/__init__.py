"""ddl_triton.tuning."""
