"""Lua scripts of the Redis tier. Each touches only keys of one run (one hash tag, one slot).

KEYS[1] is the run's index (sorted set: member = block hex, score = last use, seconds) and KEYS[2]
the run's size hash (member -> stored bytes); value keys are `<ARGV prefix><member>` and share the
run's hash tag, so every script is valid on Redis Cluster.
"""

# Index half of a put of several blocks of one run. It runs inside MULTI/EXEC, queued *before*
# the plain `SET <value key> <value> NX [PX ttl]` commands of the same blocks, so no other client
# runs in between: a value key absent now is exactly one whose SET NX will succeed. The values
# themselves never pass through Lua (no extra copies inside Redis).
# ARGV: score, then member_1, size_1, member_2, size_2, ...; KEYS[3..] are the value keys in the
# same order. Returns {added_bytes, added_blocks, flag_1, flag_2, ...} (flag 1 = will be newly
# stored). The index and size hash carry no TTL even when the values do: a block whose value
# expired stays indexed, and counted in the namespace's byte total, until an eviction reaches it
# and frees its recorded size (were the index to expire too, nothing would ever subtract those
# bytes). A member whose value expired but is still indexed is re-stored and its old size is
# replaced, not added twice.
INDEX_PUT = """
local score = ARGV[1]
local added_bytes, added_blocks = 0, 0
local out = {0, 0}
for i = 3, #KEYS do
  local j = 2 + (i - 3) * 2
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
out[1] = added_bytes
out[2] = added_blocks
return out
"""

# The least recently used blocks of one run that free ARGV[1] bytes, with their values; it
# changes nothing (an eviction deletes them afterwards with DELETE, once the caller holds the
# values: a reply lost on the way cannot take blocks with it).
# ARGV: need_bytes, value key prefix. Returns {member, value, member, value, ...}; the value is
# nil where the block's value is gone (expired) but it is still indexed.
PEEK_LRU = """
local need = tonumber(ARGV[1])
local freed, start = 0, 0
local out = {}
while freed < need do
  local batch = redis.call('ZRANGE', KEYS[1], start, start + 63)
  if #batch == 0 then break end
  for _, member in ipairs(batch) do
    if freed >= need then break end
    out[#out + 1] = member
    out[#out + 1] = redis.call('GET', ARGV[2] .. member)
    freed = freed + tonumber(redis.call('HGET', KEYS[2], member) or '0')
  end
  start = start + 64
end
return out
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
