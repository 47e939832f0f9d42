"""Device memory of a replica: the unified paged pool, KV blocks, adapters in pages and the
adapter cache (tiers, loads, eviction)."""
