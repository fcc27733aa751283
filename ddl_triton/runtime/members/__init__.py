"""Members: the parts of the elastic membership (ddl_triton/runtime/membership.py) that talk to the
job's store on its behalf: its bounded store calls and blocking waits (``store_calls``) and the
watcher thread that wakes on a revocation (``watcher``). The lowest room of the runtime: it imports
none of the others."""
