"""KV pool on Mooncake Store: block hashes, hybrid cache-hit coordination, keys, pool client.

``hashing`` names blocks, ``coordinator`` decides how much of a prompt the pool can serve and
which blocks to load and store per KV cache group, ``keys`` turns block names into pool keys,
``pool`` talks to Mooncake Store with bounded waits, ``master`` starts a loopback master.
"""
