"""Django's Redis cache, keeping its redis client.

Django's backend builds a new `redis.Redis` for every operation (a few hundred response
callbacks set up each time, over the same connection pool), which cost about as much CPU as the
round trip. Each cache handle is per thread already; this one keeps one client per connection
pool, which redis-py clients are made for (thread-safe, pooled connections).
"""

from __future__ import annotations

from django.core.cache.backends.redis import RedisCache as DjangoRedisCache
from django.core.cache.backends.redis import RedisCacheClient


class _KeptClient(RedisCacheClient):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._clients: dict[int, object] = {}

    def get_client(self, key=None, *, write=False):
        index = self._get_connection_pool_index(write)
        client = self._clients.get(index)
        if client is None:
            client = self._clients[index] = super().get_client(key, write=write)
        return client


class RedisCache(DjangoRedisCache):
    def __init__(self, server, params) -> None:
        super().__init__(server, params)
        self._class = _KeptClient
