"""The Lua scripts behind a lease.

Each script touches only the keys of one request, which share a hash tag, so every script runs
unchanged on Redis Cluster. Each is one ``EVALSHA`` round trip; :class:`Scripts` registers them
once per client (redis-py's ``Script`` reloads one transparently after ``NOSCRIPT``).

The lock is a string, ``"<token> <fence> <holder>"``: the token first, so the scripts compare it
by prefix; the fence second, so they read it without decoding anything; then the holder as JSON
(task id, task name, host, pid, ``since``), which only Python reads
(:func:`celery_lock.lease.encode_lock` / :func:`celery_lock.lease.decode_lock`). A string, not a
hash: a Lua call on the server costs about a microsecond per field written, and the grant path is
the cost of every task.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from redis.commands.core import Script

__all__ = ["ACQUIRE", "EXTEND", "RELEASE", "SWAP_HAND_ON", "Scripts"]

# KEYS[1] - lock (string "<token> <fence> <holder>")
# KEYS[2] - fence counter
# KEYS[3] - done-marker of this task name
# ARGV[1] - token
# ARGV[2] - lease TTL in milliseconds
# ARGV[3] - holder, JSON (task id, task name, host, pid, since: ms since the epoch by the caller's
#           clock, shown by `celery lock`; not read from TIME, so a user allowed only
#           @read/@write/@scripting can run this)
# ARGV[4] - fence counter TTL in milliseconds: the counter is made to live at least that long
#           (never shortened, as by EXTEND; 0 leaves it alone)
# ARGV[5] - fence seed: microseconds since the epoch by the caller's clock, the first fence of a
#           counter this grant creates (0: start at 1). A counter that lapsed (or was evicted, or
#           lost with a restart) was created at least its TTL ago and moved on by one per grant,
#           far less than a microsecond's worth each: a new counter started from the clock begins
#           above every fence the old one gave, unless the two callers' clocks differ by more than
#           the old counter lived. Not read from TIME: see ARGV[3], and the script stays
#           deterministic, so no replica runs it differently.
# ARGV[6] - (a replacement only) the message's replacement depth (Celery's
#           replaced_task_nesting), and
# ARGV[7] - its canvas's root task id: a hand-on marker ("\xffhanded-on:<depth>\xff<root id>
#           \xff<task id>", written by the release of a run that called self.replace, with
#           "handing-on" until the replacement was sent) of the same root at a lesser depth lets
#           it through (the replacement, or a step of it); every other marker answers "done"
# return <fence>                              -- granted (an integer reply, below 2^53)
#      | {"done", <the done-marker: the task id that completed it, or a hand-on marker>}
#      | {"held", "<fence> <holder>", <pttl>}  -- the holder's token is never returned
# Re-entrant: the same token is granted again (its TTL reset, fence unchanged), so an acquire
# retried after a lost reply does not report HELD against itself.
# Lua 5.1's numbers are doubles, written with 14 significant digits: concatenated, a fence of
# 10^14 would read "1e+14", and passed to a command, a TTL of 10^17 ms "1e+17". So the fence is
# written with %d (exact below 2^53, where a counter stops being one: refused) and TTLs are
# passed on as the strings they came in as.
# redis.replicate_commands() first: Redis before 5.0, and 5.0 to 6.2 with
# `lua-replicate-commands no`, replicate a script by running it again on each replica, and so
# refuse a write after a command whose answer may differ there, as PTTL's does. This script reads
# the fence counter's PTTL and may PEXPIRE it and SET the lock next (a request's second grant
# failed, its fence already taken), as EXTEND does (every extend lost its lease). The call has
# the server replicate the script's writes instead; Redis 7 always does (a no-op there).
ACQUIRE = """
redis.replicate_commands()
local done = redis.call('GET', KEYS[3])  -- GET, not MGET: MGET reads a key of another type
if done then                             -- as nil, and garbage must not pass for "free"
    local depth, root = false, false
    if ARGV[6] then
        depth, root = string.match(done, '^\\255hand%l+%-on:(%d+)\\255([^\\255]*)\\255')
    end
    if not (root == ARGV[7] and tonumber(depth) < tonumber(ARGV[6])) then
        return {'done', done}
    end
end
local lock = redis.call('GET', KEYS[1])
if lock then
    local mine = ARGV[1] .. ' '
    if string.sub(lock, 1, #mine) == mine then
        redis.call('PEXPIRE', KEYS[1], ARGV[2])
        return tonumber(string.match(lock, '^%S+ (%d+)'))
    end
    return {'held', string.match(lock, '^%S* (.*)$') or lock, redis.call('PTTL', KEYS[1])}
end
local fence_ttl = tonumber(ARGV[4])
local fence, text = false, ARGV[5]
if text ~= '0' then       -- a new counter starts at the clock, with its TTL: one call for a new
    if fence_ttl > 0 then  -- request's grant, the usual one
        fence = redis.call('SET', KEYS[2], text, 'NX', 'PX', ARGV[4])
    else
        fence = redis.call('SET', KEYS[2], text, 'NX')
    end
    fence = fence and tonumber(text)
end
if not fence then  -- the counter lives (or holds what INCR refuses: its error is the reply)
    fence = redis.call('INCR', KEYS[2])
    if fence >= 9007199254740992 then
        return redis.error_reply('ERR fence counter past 2^53')
    end
    if fence_ttl > 0 then
        if fence == 1 then  -- a counter INCR just created (no seed): no TTL to compare
            redis.call('PEXPIRE', KEYS[2], ARGV[4])
        else  -- as EXTEND: never shortened (another task of the scope may want it longer)
            local left = redis.call('PTTL', KEYS[2])  -- -1: kept for ever, as it was
            if left >= 0 and left < fence_ttl then
                redis.call('PEXPIRE', KEYS[2], ARGV[4])
            end
        end
    end
    text = string.format('%d', fence)
end
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. text .. ' ' .. ARGV[3], 'PX', ARGV[2])
return fence
"""

# KEYS[1] - lock
# KEYS[2] - fence counter
# ARGV[1] - token
# ARGV[2] - lease TTL in milliseconds (set, not added)
# ARGV[3] - fence counter TTL in milliseconds: the counter is made to live at least that long
#           (never shortened; 0 leaves it alone), so a run that outlasts the TTL the grant gave
#           it cannot see its counter expire and the next grant's fence start from a clock
# return 1 if the token still owns the lock and its TTL was reset, 0 if the lease is lost
# redis.replicate_commands() first: see ACQUIRE.
EXTEND = """
redis.replicate_commands()
local lock = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ' '
if lock and string.sub(lock, 1, #mine) == mine then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    local fence_ttl = tonumber(ARGV[3])
    if fence_ttl > 0 then
        local left = redis.call('PTTL', KEYS[2])  -- -2: no counter, -1: kept for ever
        if left >= 0 and left < fence_ttl then
            redis.call('PEXPIRE', KEYS[2], ARGV[3])
        end
    end
    return 1
end
return 0
"""

# KEYS[1] - lock
# KEYS[2] - done-marker of this task name
# KEYS[3] - fence counter
# ARGV[1] - token
# ARGV[2] - done-marker TTL in milliseconds
# ARGV[3] - outcome: "success" writes the done-marker, anything else does not
# ARGV[4] - the done-marker's value: the task id, or a hand-on marker (see ACQUIRE)
# ARGV[5] - the lease's fence
# return 1 if the token owned the lock (now deleted)
#      | 2 if it no longer does but this very release already deleted it, an earlier try whose
#          reply was lost (success only): the done-marker names this task id, the lock is gone
#          and no grant was made since this lease's. Only the lock's owner writes a marker, and
#          every grant to another token moves the counter on, as one to a redelivered copy of
#          the same message (same task id) that wrote the marker after this lease lapsed.
#      | 3 if it no longer does, and an earlier try of this release may have deleted it: a
#          failure's release leaves nothing to tell that from a loss; a success's marker names
#          this task id but a grant was made since (another task of a shared scope after this
#          release, or a redelivered copy of the same message after this lease lapsed)
#      | 0 if the lease had been lost before any try of this release ran (success: the marker
#          does not name this task id)
# Only a lease not found holding the lock reads the marker and the counter: the usual release is
# the same commands as ever.
RELEASE = """
local lock = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ' '
if lock and string.sub(lock, 1, #mine) == mine then
    redis.call('DEL', KEYS[1])
    if ARGV[3] == 'success' then
        redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[2])
    end
    return 1
end
if ARGV[3] ~= 'success' then
    return 3
end
if redis.call('GET', KEYS[2]) ~= ARGV[4] then
    return 0
end
if not lock and redis.call('GET', KEYS[3]) == ARGV[5] then
    return 2
end
return 3
"""


# KEYS[1] - done-marker of this task name
# ARGV[1] - the hand-on marker a release wrote before sending the replacement (see ACQUIRE)
# ARGV[2] - what takes its place: the marker of a replacement that was sent, or "" to delete it
#           (the replacement was not sent, and a later copy must run the request)
# ARGV[3] - with a marker in ARGV[2], the done-marker TTL in milliseconds; with "", 0, or the
#           most TTL the marker may have left to be deleted: one written since then may be
#           its run's, alive and still sending the replacement
# return 1 if the done-marker still was ARGV[1] (now replaced or deleted), -1 if it was but is
#        too young to delete, else 0: the replacement ran and wrote a marker of its own, or the
#        marker expired
# The confirmation DELs the marker before it SETs the new one: a server out of memory under
# `maxmemory-policy noeviction` refuses a script's first write if that is one that may add
# memory (SET) but lets later ones through, so the marker of a replacement already sent is
# confirmed even then (as RELEASE, whose first write is a DEL, writes it).
# redis.replicate_commands() first, as in ACQUIRE: PTTL's answer may differ on a replica.
SWAP_HAND_ON = """
redis.replicate_commands()
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
if ARGV[2] == '' then
    local most = tonumber(ARGV[3])
    if most > 0 and redis.call('PTTL', KEYS[1]) > most then
        return -1
    end
    return redis.call('DEL', KEYS[1])
end
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""


@dataclass(frozen=True)
class Scripts:
    """The scripts registered on one client."""

    acquire: Script
    extend: Script
    release: Script
    swap_hand_on: Script

    @classmethod
    def register(cls, client: redis.Redis) -> Scripts:
        """Register the scripts with ``client`` (no round trip until first use)."""
        return cls(
            acquire=client.register_script(ACQUIRE),
            extend=client.register_script(EXTEND),
            release=client.register_script(RELEASE),
            swap_hand_on=client.register_script(SWAP_HAND_ON),
        )
