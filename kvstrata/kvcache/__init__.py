"""KV-cache accounting (block pools, hashing, tiers) and its physical buffers."""
