"""`tokenmill bench`: offline throughput, single-request latency, and a load generator for the server."""
