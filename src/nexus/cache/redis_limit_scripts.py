"""The Lua scripts of the per-key limits in Redis (:mod:`nexus.cache.redis_limits`, whose
docstring says what each key holds): each runs atomically in Redis, so that replicas
checking and taking the same key's limits at once cannot both take its last place."""

from __future__ import annotations

__all__ = ["ADMIT", "CHARGE", "RECONCILE", "RENEW"]

# KEYS: the rate bucket, the slots (of streams, sockets or readers), the spend, the holds.
# ARGV: rate per second (0: none), bucket capacity, slot limit (0: none), slot id ("": no
#       slot), lease ms, budget (negative: none), hold USD.
# Returns {0, ""} admitted; {1, wait ms} no token; {2, ""} no slot; {3, spend, held}
# budget spent, or its rest held.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local slot = ARGV[4]
if slot ~= '' then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
local budget = tonumber(ARGV[6])
local hold = tonumber(ARGV[7])
if budget >= 0 then
  local spent = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
  local held = 0
  local holds = redis.call('HGETALL', KEYS[4])
  for i = 1, #holds, 2 do
    if redis.call('ZSCORE', KEYS[2], holds[i]) then
      held = held + tonumber(holds[i + 1])
    else
      redis.call('HDEL', KEYS[4], holds[i])
    end
  end
  if spent >= budget or spent + held + hold > budget then
    return {3, tostring(spent), tostring(held)}
  end
end
local rate = tonumber(ARGV[1])
if rate > 0 then
  local capacity = tonumber(ARGV[2])
  local bucket = redis.call('HMGET', KEYS[1], 't', 'at')
  local tokens = tonumber(bucket[1]) or capacity
  local at = tonumber(bucket[2]) or now
  if now > at then
    tokens = math.min(capacity, tokens + (now - at) * rate / 1000)
    at = now
  end
  local ok = tokens >= 1
  if ok then tokens = tokens - 1 end
  redis.call('HSET', KEYS[1], 't', tostring(tokens), 'at', tostring(at))
  redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate * 1000) + 1000)
  if not ok then return {1, tostring(math.ceil((1 - tokens) * 1000 / rate))} end
end
if slot ~= '' then
  local limit = tonumber(ARGV[3])
  local lease = tonumber(ARGV[5])
  if limit > 0 and redis.call('ZCARD', KEYS[2]) >= limit then return {2, ''} end
  redis.call('ZADD', KEYS[2], now + lease, slot)
  redis.call('PEXPIRE', KEYS[2], lease * 2)
  if hold > 0 then
    redis.call('HSET', KEYS[4], slot, ARGV[7])
    redis.call('PEXPIRE', KEYS[4], lease * 2)
  end
end
return {0, ''}
"""

# KEYS: a key's stream slots, its holds (none for its sockets' or readers' slots). ARGV:
# lease ms, then for each slot held here its id and its hold (USD; 0: none, or charged
# already).
# Not XX: a slot Redis lost (it restarted, or was unreachable past the set's TTL, or this
# process stalled past the lease and another admission dropped it) comes back, since its
# stream still runs, and its hold with it: a slot back without its hold would let the key
# spend that hold twice. Until those streams end the key may be over its limits, which
# then refuse it, never the reverse.
RENEW = """
local t = redis.call('TIME')
local lease = tonumber(ARGV[1])
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + lease
for i = 2, #ARGV, 2 do
  redis.call('ZADD', KEYS[1], deadline, ARGV[i])
  if KEYS[2] and tonumber(ARGV[i + 1]) > 0 then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  end
end
redis.call('PEXPIRE', KEYS[1], lease * 2)
if KEYS[2] then redis.call('PEXPIRE', KEYS[2], lease * 2) end
return 0
"""

# KEYS: the spend, the charge's marker, the key's holds. ARGV: USD, the spend's TTL ms
# (0: none), the marker's TTL ms, the slot whose hold the charge replaces ("": none). A
# charge sent again (its reply was lost: redis-py and the tick retry it) finds its marker
# and adds nothing.
CHARGE = """
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[3]) then
  redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
  local ttl = tonumber(ARGV[2])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
end
if ARGV[4] ~= '' then redis.call('HDEL', KEYS[3], ARGV[4]) end
return 0
"""

RECONCILE = (
    "if redis.call('SET', KEYS[2], '1', 'NX', 'PX', 86400000) then "
    "local spent = redis.call('INCRBYFLOAT', KEYS[1], ARGV[1]) "
    "if tonumber(ARGV[2]) > 0 and redis.call('PTTL', KEYS[1]) == -1 then "
    "redis.call('PEXPIREAT', KEYS[1], ARGV[2]) end "
    "return spent end"
)
"""A lost charge added by hand (its ERROR line's command): once, under the charge's marker,
whether or not the charge itself landed after all (within its marker's life); a spend key
it makes expires when its period's would (ARGV[2], epoch ms; 0: never)."""
