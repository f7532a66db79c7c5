"""The Lua scripts behind a lease.

Each script touches only the keys of one request, which share a hash tag, so every script runs
unchanged on Redis Cluster. Each is one ``EVALSHA`` round trip; :class:`Scripts` registers them
once per client (redis-py's ``Script`` reloads one transparently after ``NOSCRIPT``).

The lock is a hash: ``token``, ``task_id``, ``task``, ``host``, ``pid``, ``fence``, ``since`` (ms
since the epoch, by the acquiring worker's clock).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from redis.commands.core import Script

__all__ = ["ACQUIRE", "EXTEND", "RELEASE", "Scripts"]

# KEYS[1] - lock (hash)
# KEYS[2] - fence counter
# KEYS[3] - done-marker of this task name
# ARGV[1] - token
# ARGV[2] - lease TTL in milliseconds
# ARGV[3] - holder task id
# ARGV[4] - holder task name
# ARGV[5] - holder host
# ARGV[6] - holder pid
# ARGV[7] - fence counter TTL in milliseconds
# ARGV[8] - when the lease starts, ms since the epoch (the caller's clock: shown by `celery lock`;
#           not read from TIME, so a user allowed only @read/@write/@scripting can run this)
# return {"done", <task id that completed it>}
#      | {"held", <holder task id>, <holder task name>, <pttl>}
#      | {"acquired", <fence>}
# Re-entrant: the same token is granted again (its TTL reset, fence unchanged), so an acquire
# retried after a lost reply does not report HELD against itself.
ACQUIRE = """
local done = redis.call('GET', KEYS[3])
if done then
    return {'done', done}
end
local owner = redis.call('HMGET', KEYS[1], 'token', 'task_id', 'task', 'fence')
if owner[1] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {'acquired', owner[4]}
end
if redis.call('EXISTS', KEYS[1]) == 1 then
    return {'held', owner[2] or '', owner[3] or '', redis.call('PTTL', KEYS[1])}
end
local fence = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[7])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'task_id', ARGV[3], 'task', ARGV[4],
           'host', ARGV[5], 'pid', ARGV[6], 'fence', fence, 'since', ARGV[8])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'acquired', fence}
"""

# KEYS[1] - lock
# ARGV[1] - token
# ARGV[2] - lease TTL in milliseconds (set, not added)
# return 1 if the token still owns the lock and its TTL was reset, 0 if the lease is lost
EXTEND = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
"""

# KEYS[1] - lock
# KEYS[2] - done-marker of this task name
# ARGV[1] - token
# ARGV[2] - done-marker TTL in milliseconds
# ARGV[3] - outcome: "success" writes the done-marker, anything else does not
# ARGV[4] - task id to record in the done-marker
# return 1 if the token owned the lock (now deleted), 0 if the lease had been lost
RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
    redis.call('DEL', KEYS[1])
    if ARGV[3] == 'success' then
        redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[2])
    end
    return 1
end
return 0
"""


@dataclass(frozen=True)
class Scripts:
    """The three scripts registered on one client."""

    acquire: Script
    extend: Script
    release: Script

    @classmethod
    def register(cls, client: redis.Redis) -> Scripts:
        """Register the scripts with ``client`` (no round trip until first use)."""
        return cls(
            acquire=client.register_script(ACQUIRE),
            extend=client.register_script(EXTEND),
            release=client.register_script(RELEASE),
        )
