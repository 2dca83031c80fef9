"""The Lua scripts of :class:`~botmesh.redis_store.kv.RedisKv` (kept apart so that the
kv's module stays about the kv; what each call does with them is described there)."""

from __future__ import annotations

__all__ = ["DELETE", "PUT", "RANGES", "SCAN"]

# KEYS: 1 records hash, 2 due zset, 3 expires zset, 4 keys zset (all one hash tag).
# The stored text starts with {"version":<n>, -- written only by PUT below.
_VERSION_OF = """
local function version_of(text)
  if not text then return 0 end
  local v = string.match(text, '^{"version":(%d+),')
  if not v then return redis.error_reply('botmesh: malformed record in ' .. KEYS[1]) end
  return tonumber(v)
end
"""

# ARGV: 1 key, 2 expected version, 3 value JSON, 4 due score or "", 5 expires score or "".
# Returns {1, new version} or {0, current version, current record text if it exists}.
PUT = _VERSION_OF + """
local text = redis.call('HGET', KEYS[1], ARGV[1])
local current = version_of(text)
if type(current) == 'table' then return current end
if current ~= tonumber(ARGV[2]) then
  if text then return {0, current, text} end
  return {0, current}
end
local new = current + 1
redis.call('HSET', KEYS[1], ARGV[1], '{"version":' .. string.format('%d', new) .. ',"value":' .. ARGV[3] .. '}')
if ARGV[4] == '' then redis.call('ZREM', KEYS[2], ARGV[1]) else redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1]) end
if ARGV[5] == '' then redis.call('ZREM', KEYS[3], ARGV[1]) else redis.call('ZADD', KEYS[3], ARGV[5], ARGV[1]) end
redis.call('ZADD', KEYS[4], 0, ARGV[1])
return {1, new}
"""

# ARGV: 1 key, 2 expected version. Returns {1, version} or as PUT (0: absent).
DELETE = _VERSION_OF + """
local text = redis.call('HGET', KEYS[1], ARGV[1])
local current = version_of(text)
if type(current) == 'table' then return current end
if current == 0 then return {0, 0} end
if current ~= tonumber(ARGV[2]) then return {0, current, text} end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return {1, current}
"""

# KEYS: 1 records hash, 2 keys zset. ARGV: 1 ZRANGEBYLEX min ("-" or "(" .. after),
# 2 count (-1: all). Returns {key1, record1, key2, record2, ...} in key byte order.
SCAN = """
local keys = redis.call('ZRANGEBYLEX', KEYS[2], ARGV[1], '+', 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, k in ipairs(keys) do
  local record = redis.call('HGET', KEYS[1], k)
  if record then
    out[#out + 1] = k
    out[#out + 1] = record
  end
end
return out
"""

RANGES = """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('ZRANGEBYSCORE', key, '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
end
return out
"""
"""Several ``ZRANGEBYSCORE ... WITHSCORES LIMIT 0 n`` reads in one command (:meth:`~botmesh.redis_store.kv.RedisKv.ranges`)."""
