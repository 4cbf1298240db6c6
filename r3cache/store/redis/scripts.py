"""The Lua scripts behind the Redis store, and how they are called.

Every script takes its keys through ARGV and declares ``allow-cross-slot-keys``:
the store sends one call per cluster node per batch, covering every key that node
serves (a script may touch any slot its node owns). Each script first reads every
key it will write, so a key the node does not serve (a stale slot map after a
failover) fails the call before anything is written.
"""

from __future__ import annotations

import hashlib

_SHEBANG = "#!lua flags=allow-cross-slot-keys\n"
# Holds must change even when Redis is out of memory: releasing is how memory frees up.
_HOLDS_SHEBANG = "#!lua flags=allow-cross-slot-keys,allow-oom\n"

# After a key's holds changed: pinned blocks lose their TTL (so volatile-* eviction
# cannot take them); a block nobody holds gets the idle TTL, 10 ms longer per rank,
# so that blocks released together expire (and volatile-ttl evicts them) in release order.
_SETTLE = """
local function settle(block, refs, idle_ms, rank)
  if redis.call('EXISTS', refs) == 1 then
    redis.call('PERSIST', block)
  else
    redis.call('PEXPIRE', block, idle_ms + 10 * rank)
  end
end
"""

# ARGV: owner, idle_ms, then per key 4 values: block key, refs key, count, rank.
# Sets this owner's hold count on each block (none at 0), then settles each block's TTL.
# Counts are what the owner holds, not changes to them: a call sent again (a round
# retried after a topology change or a dropped connection, a put retried after it
# failed halfway) leaves the same counts. Block bytes never pass through Lua: they go
# by native SET NX.
HOLDS = _HOLDS_SHEBANG + _SETTLE + """
local owner, idle_ms = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV, 4 do
  redis.call('EXISTS', ARGV[i], ARGV[i + 1])
end
for i = 3, #ARGV, 4 do
  local block, refs, count = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if count > 0 then
    redis.call('HSET', refs, owner, count)
  else
    redis.call('HDEL', refs, owner)
  end
  settle(block, refs, idle_ms, tonumber(ARGV[i + 3]))
end
return 1
"""

# ARGV: groups of n, n owners, m, then m pairs (block key, refs key). Each owner of a
# group holds each of the group's blocks once (a count of 1, however often the call is
# sent), and the blocks then have no TTL: the manifests of finished requests holding
# their blocks, where the samples of one prompt share its blocks (one call names each
# block once, not once per manifest).
MANIFEST_HOLDS = _HOLDS_SHEBANG + """
local function each_group(apply)
  local i = 1
  while i <= #ARGV do
    local n = tonumber(ARGV[i])
    local first = i + n + 2
    local last = first + 2 * tonumber(ARGV[i + n + 1]) - 1
    apply(i + 1, i + n, first, last)
    i = last + 1
  end
end
each_group(function(_, _, first, last)
  for k = first, last, 2 do
    redis.call('EXISTS', ARGV[k], ARGV[k + 1])
  end
end)
each_group(function(owner1, ownern, first, last)
  for k = first, last, 2 do
    for o = owner1, ownern do
      redis.call('HSET', ARGV[k + 1], ARGV[o], 1)
    end
    redis.call('PERSIST', ARGV[k])
  end
end)
return 1
"""

# ARGV: idle_ms, number of owners n, n owners, then pairs (refs key, block key).
# Drops every hold of those owners; returns how many holds were dropped.
RECLAIM = _HOLDS_SHEBANG + _SETTLE + """
local idle_ms, n = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3 + n, #ARGV, 2 do
  redis.call('EXISTS', ARGV[i], ARGV[i + 1])
end
local dropped = 0
for i = 3 + n, #ARGV, 2 do
  local refs, block = ARGV[i], ARGV[i + 1]
  local changed = 0
  for j = 3, 2 + n do
    changed = changed + redis.call('HDEL', refs, ARGV[j])
  end
  if changed > 0 then
    dropped = dropped + changed
    settle(block, refs, idle_ms, 0)
  end
end
return dropped
"""

# The text of an owners-registry entry the janitor made for a holder it found unregistered.
JANITOR_FOUND = "unregistered holder found by the janitor"

# The owners registry: one hash without a TTL, owner -> "<expiry ms> <info>", the expiry
# read from the server's clock. No TTL, so volatile-* eviction cannot take a live owner's
# lease; the scripts allow OOM, so a full Redis cannot refuse a heartbeat. An expiry of 0
# marks an owner the janitor is reclaiming. Where the ACL user may not run TIME, the
# caller's clock (passed in) stands in for the server's.
_NOW = """
local function now_ms(fallback)
  local t = redis.pcall('TIME')
  if t['err'] then return tonumber(fallback) end
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function expiry(entry)
  return tonumber(string.match(entry, '^(%d+)'))
end
local function info(entry)
  return (string.gsub(entry, '^%d+ ?', ''))
end
local JANITOR_FOUND = '""" + JANITOR_FOUND + """'
"""

# ARGV: owners key, owner, ttl_ms, info, mode, the caller's clock (ms), then for "open"
# the entry the caller found to be an earlier incarnation's ("" for none).
# open: registers the owner where its name is free: no entry (returns 1), an expired one
# no janitor is reclaiming, or the given earlier incarnation's (returns 2: its holds must
# be dropped). A live entry, or one a janitor is reclaiming, stays: returns {the entry,
# ms left of its lease (-1: being reclaimed)}, and the caller decides.
# beat: extends this incarnation's entry (returns 1; an entry the janitor made for a holder
# it found unregistered becomes this one's); leaves an entry being reclaimed alone
# (returns 0); re-registers an owner whose entry is gone, after a reclaim or a Redis
# restart without persistence (returns -1: its holds must be applied again); returns -2,
# changing nothing, where another incarnation registered the name.
# close: drops the entry if it is this incarnation's, or the janitor's for this owner's
# holds (the closing store drops them first), and returns 1; else 0.
REGISTER = _HOLDS_SHEBANG + _NOW + """
local key, owner, ttl, text, mode = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local old = redis.call('HGET', key, owner)
if mode == 'close' then
  if old and (info(old) == text or info(old) == JANITOR_FOUND) then
    return redis.call('HDEL', key, owner)
  end
  return 0
end
local now = now_ms(ARGV[6])
if mode == 'beat' and old then
  local was = info(old)
  if was ~= text and was ~= JANITOR_FOUND then return -2 end
  if expiry(old) == 0 then return 0 end
end
if mode == 'open' and old and old ~= ARGV[7] then
  local e = expiry(old) or 0
  if e == 0 then return {old, -1} end
  if e > now then return {old, e - now} end
end
redis.call('HSET', key, owner, (now + ttl) .. ' ' .. text)
if mode == 'beat' then
  if old then return 1 else return -1 end
end
if old then return 2 else return 1 end
"""

# ARGV: owners key, grace_ms, the caller's clock (ms), then holders found in reference
# hashes. A holder with no
# entry gets one that expires after grace_ms (a live owner's next heartbeat keeps it);
# entries past their expiry are marked as being reclaimed. Returns {dead, live} names.
SWEEP = _HOLDS_SHEBANG + _NOW + """
local key, grace = ARGV[1], tonumber(ARGV[2])
local now = now_ms(ARGV[3])
for i = 4, #ARGV do
  redis.call('HSETNX', key, ARGV[i], (now + grace) .. ' ' .. JANITOR_FOUND)
end
local entries = redis.call('HGETALL', key)
local dead, live = {}, {}
for i = 1, #entries, 2 do
  local owner, entry = entries[i], entries[i + 1]
  local e = expiry(entry) or 0
  if e > now then
    table.insert(live, owner)
  else
    if e > 0 then redis.call('HSET', key, owner, '0 ' .. info(entry)) end
    table.insert(dead, owner)
  end
end
return {dead, live}
"""

# ARGV: owners key, then owners whose holds were dropped: their entries go, unless the
# owner came back meanwhile (a live expiry again).
FORGET = _HOLDS_SHEBANG + _NOW + """
local forgotten = 0
for i = 2, #ARGV do
  local entry = redis.call('HGET', ARGV[1], ARGV[i])
  if entry and expiry(entry) == 0 then
    forgotten = forgotten + redis.call('HDEL', ARGV[1], ARGV[i])
  end
end
return forgotten
"""

# ARGV: a hash key, then field/value pairs. Replaces the whole hash at once.
REPLACE_HASH = _SHEBANG + """
redis.call('DEL', ARGV[1])
redis.call('HSET', unpack(ARGV))
return 1
"""

# ARGV: meta key, then field/value pairs.
# Creates the namespace metadata unless it exists (also under OOM: a few bytes that
# every reader needs); returns the stored fields.
OPEN_NAMESPACE = _HOLDS_SHEBANG + """
local meta = ARGV[1]
if redis.call('EXISTS', meta) == 0 then
  for i = 2, #ARGV, 2 do
    redis.call('HSET', meta, ARGV[i], ARGV[i + 1])
  end
end
return redis.call('HGETALL', meta)
"""


class Script:
    """Own one script's source and SHA-1, for EVALSHA with a SCRIPT LOAD fallback."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def command(self, *args) -> tuple:
        return ("EVALSHA", self.sha, 0, *args)


HOLDS_SCRIPT = Script(HOLDS)
MANIFEST_HOLDS_SCRIPT = Script(MANIFEST_HOLDS)
REPLACE_HASH_SCRIPT = Script(REPLACE_HASH)
RECLAIM_SCRIPT = Script(RECLAIM)
OPEN_NAMESPACE_SCRIPT = Script(OPEN_NAMESPACE)
REGISTER_SCRIPT = Script(REGISTER)
SWEEP_SCRIPT = Script(SWEEP)
FORGET_SCRIPT = Script(FORGET)
SCRIPTS = {s.sha: s for s in (HOLDS_SCRIPT, MANIFEST_HOLDS_SCRIPT, RECLAIM_SCRIPT,
                                OPEN_NAMESPACE_SCRIPT, REPLACE_HASH_SCRIPT, REGISTER_SCRIPT,
                                SWEEP_SCRIPT, FORGET_SCRIPT)}
