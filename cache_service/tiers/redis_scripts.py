"""Lua scripts of the Redis tier. Each touches only keys of one run (one hash tag, one slot).

KEYS[1] is the run's index (sorted set: member = block hex, score = last use, seconds) and KEYS[2]
the run's size hash (member -> stored bytes); value keys are `<ARGV prefix><member>` and share the
run's hash tag, so every script is valid on Redis Cluster.
"""

# Index half of a put of several blocks of one run. It runs inside MULTI/EXEC, queued *before*
# the plain `SET <value key> <value> NX [PX ttl]` commands of the same blocks, so no other client
# runs in between: a value key absent now is exactly one whose SET NX will succeed. The values
# themselves never pass through Lua (no extra copies inside Redis).
# ARGV: ttl_ms (0 = none), score, then member_1, size_1, member_2, size_2, ...; KEYS[3..] are the
# value keys in the same order. Returns {added_bytes, added_blocks, flag_1, flag_2, ...}
# (flag 1 = will be newly stored). A member whose value expired (TTL) but is still indexed is
# re-stored and its old size is replaced, not added twice.
INDEX_PUT = """
local ttl = tonumber(ARGV[1])
local score = ARGV[2]
local added_bytes, added_blocks = 0, 0
local out = {0, 0}
for i = 3, #KEYS do
  local j = 3 + (i - 3) * 2
  local member, size = ARGV[j], tonumber(ARGV[j + 1])
  if redis.call('EXISTS', KEYS[i]) == 0 then
    local old = redis.call('HGET', KEYS[2], member)
    if old then
      added_bytes = added_bytes + size - tonumber(old)
    else
      added_bytes = added_bytes + size
      added_blocks = added_blocks + 1
    end
    redis.call('HSET', KEYS[2], member, size)
    redis.call('ZADD', KEYS[1], score, member)
    out[#out + 1] = 1
  else
    redis.call('ZADD', KEYS[1], 'XX', score, member)
    out[#out + 1] = 0
  end
end
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
out[1] = added_bytes
out[2] = added_blocks
return out
"""

# Evict the least recently used blocks of one run until ARGV[1] bytes are freed.
# ARGV: need_bytes, value key prefix, return_values (1/0). Returns
# {freed_bytes, freed_blocks, blocks_left_in_run, {member, value, member, value, ...}}.
EVICT_LRU = """
local need = tonumber(ARGV[1])
local freed, count = 0, 0
local out = {}
while freed < need do
  local popped = redis.call('ZPOPMIN', KEYS[1], 1)
  if #popped == 0 then break end
  local member = popped[1]
  local size = tonumber(redis.call('HGET', KEYS[2], member) or '0')
  redis.call('HDEL', KEYS[2], member)
  local key = ARGV[2] .. member
  if ARGV[3] == '1' then
    local value = redis.call('GET', key)
    if value then
      out[#out + 1] = member
      out[#out + 1] = value
    end
  end
  redis.call('UNLINK', key)
  freed = freed + size
  count = count + 1
end
return {freed, count, redis.call('ZCARD', KEYS[1]), out}
"""

# Delete given blocks of one run. ARGV: value key prefix, member_1, member_2, ...
# Returns {freed_bytes, freed_blocks, values_deleted, blocks_left_in_run}.
DELETE = """
local freed, count, deleted = 0, 0, 0
for i = 2, #ARGV do
  local member = ARGV[i]
  deleted = deleted + redis.call('UNLINK', ARGV[1] .. member)
  local size = redis.call('HGET', KEYS[2], member)
  if size then
    freed = freed + tonumber(size)
    count = count + 1
    redis.call('HDEL', KEYS[2], member)
  end
  redis.call('ZREM', KEYS[1], member)
end
return {freed, count, deleted, redis.call('ZCARD', KEYS[1])}
"""
