"""Local swarms: a DHT peer, servers and API servers as child processes on 127.0.0.1, each running the
`corolla` command line (for `corolla demo`, tests and benchmarks)."""
