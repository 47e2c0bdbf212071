"""Pure data every layer shares: requests and their sampling parameters, chained block hashes,
configuration, the machine's facts. No torch, no store or network I/O."""
