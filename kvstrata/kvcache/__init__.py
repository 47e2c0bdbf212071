"""KV-cache accounting (block pools, tiers, transfers, stores) and its physical buffers; block hashes come from kvstrata.core.hashing."""
