"""The Redis backend: RedisBlockStore (store), opening it from a URL (connect), the key
schema (keys), its Lua scripts (scripts), per-node command rounds (nodes), the one
boundary where redis-py errors become r3cache's (errors) and leases of dead owners
(janitor)."""
