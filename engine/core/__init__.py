"""Request state: sequences and requests, the scheduler, the block manager and its block hashes."""
