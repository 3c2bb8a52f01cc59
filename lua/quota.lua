--[[ quota.lua: record one usage report of Envoy's quota service (RLQS)
for every bucket it lists, atomically per call (one call per report
message; on a Redis Cluster one per hash slot of its buckets). The Rust model is the memory backend's `Storage::report`
(src/storage/memory.rs); src/storage/quota.rs documents the semantics.

Assembly: src/storage/redis/quota_script.rs builds the script text at build
time as the request script's is (lua/request.lua, "Assembly": the same
algorithm parts under lua/algorithms/, made on first use, and the functions
each returns), then this file. So the charge below is computed by the
same arithmetic as a ShouldRateLimit charge on the same bucket.

Units: amounts in micro-units (1 token = 1,000,000), times in microseconds
since the Unix epoch, all integers below 2^53.

KEYS        per report entry i, two keys: KEYS[2i-1] the rule's bucket (the
            key ShouldRateLimit charges), KEYS[2i] its subscriber records (a
            hash: `<prefix>q{<bucket key>}`, or `<prefix>q<bucket key after
            the prefix>` under a prefix with a hash tag; in the bucket's
            Redis Cluster hash slot either way, `subscribers_key` in
            src/storage/quota.rs). On a Cluster every key of one call is in
            one slot (one call per slot of a report).
ARGV[1]     explicit now in microseconds, TESTS ONLY ("" = Redis TIME).
ARGV[2]     shortest expiry in milliseconds, TESTS ONLY ("" = none).
ARGV[3]     the entries, 64 bytes each, big-endian unsigned:
              32 bytes: the charge, packed exactly as one charge of
                        lua/request.lua's ARGV[3] (its key index is unused):
                        the allowed count as a consume on a bucket with a
                        debt bound, so it is taken even past the balance,
                        clamped at the debt bound; cost 0 charges nothing.
              8 bytes:  the subscriber's demand, thousandths of a request
                        a second.
              4 bytes:  tokens per fill of the assignment it holds
                        (4294967295: none).
              4 bytes:  max tokens of that assignment (4294967295: none).
              8 bytes:  live_ms: a record older than this is dropped, and
                        the hash expires this long after the last report;
                        0: the subscriber leaves (its record alone is
                        removed, nothing else changes, and the entry's
                        reply lists no records).
              4 bytes:  the rule's budget: tokens per fill over all
                        subscribers.
              4 bytes:  the rule's budget: max tokens over all subscribers.
ARGV[3+i]   the subscriber id of entry i (a hash field): one report may
            carry several subscribers (one per bucket id of a stream).

The assignment recorded is the one given, cut field by field to what the
other live records leave of the budget (`fit` in src/storage/quota.rs), in
this one atomic call: the recorded assignments of a bucket never sum above
its budget, whatever the interleaving of streams and replicas (but for max
tokens: an assignment with tokens per fill holds at least one token, and a
single token held so is not counted against the burst, so that a burst smaller than the number of
subscribers neither leaves a subscriber a rate it cannot use nor crowds the
others' burst out).

Each record (hash field = subscriber id) is 24 bytes, big-endian:
demand (8), tokens per fill (4), max tokens (4), last report now (8).

Reply: an array, per entry: the bucket's balance after the charge
(integer, micro-tokens, negative in debt), then an array of the live
records as field, value, field, value, ... (the reporter's included).
]]

local MICRO = 1000000
local MAX_TTL_MS = 1000000000000000
local min_ttl = tonumber(ARGV[2]) or 0
local rcall = redis.call
local spack, sunpack = struct.pack, struct.unpack
local READ, CONSUME, REPORT, ENCODE = 1, 3, 5, 6

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = rcall('TIME')
  now = tonumber(t[1]) * MICRO + tonumber(t[2])
end

local function put(key, alg, level, p1, p2, p3)
  local value, ttl = alg[ENCODE](level, now, p1, p2, p3)
  if value == nil then
    rcall('DEL', key)
  else
    if ttl < min_ttl then
      ttl = min_ttl
    end
    if ttl > MAX_TTL_MS then
      ttl = MAX_TTL_MS
    end
    rcall('SET', key, value, 'PX', string.format('%d', ttl))
  end
end

local NONE = 4294967295

-- Records `subscriber`'s report in the hash `records`: drops the stale
-- records, sums what the others hold, then writes this subscriber's record
-- with its assignment cut to fit. Returns the live records (field, value,
-- ...), this one's included.
local function record(records, subscriber, demand, tpf, maxt, live_ms, btpf, bmax)
  local all = rcall('HGETALL', records)
  local live = {}
  local live_us = live_ms * 1000
  local used_t, used_m = 0, 0
  for j = 1, #all, 2 do
    if all[j] ~= subscriber then
      local seen, t, m = 0, NONE, NONE
      if #all[j + 1] == 24 then
        local _d
        _d, t, m, seen = sunpack('>I8I4I4I8', all[j + 1])
      end
      if now - seen >= live_us then
        rcall('HDEL', records, all[j])
      else
        if t ~= NONE then
          used_t = used_t + t
          -- A part of the rate holding a single token counts 0 against
          -- the burst (`max_against_burst`).
          if t > 0 and m == 1 then
            m = 0
          end
          used_m = used_m + m
        end
        live[#live + 1] = all[j]
        live[#live + 1] = all[j + 1]
      end
    end
  end
  if tpf ~= NONE then
    tpf = math.min(tpf, math.max(0, btpf - used_t))
    maxt = math.min(maxt, math.max(0, bmax - used_m))
    -- A part of the rate holds at least one token (a bucket that holds
    -- nothing admits nothing), counted 0: held may pass the burst by one a
    -- subscriber.
    if tpf > 0 and maxt == 0 then
      maxt = 1
    end
  end
  local mine = spack('>I8I4I4I8', demand, tpf, maxt, now)
  rcall('HSET', records, subscriber, mine)
  live[#live + 1] = subscriber
  live[#live + 1] = mine
  local ttl = live_ms
  if ttl < min_ttl then
    ttl = min_ttl
  end
  rcall('PEXPIRE', records, string.format('%d', ttl))
  return live
end

local packed = ARGV[3]
local n = #packed / 64
local reply = {}
local pos = 1
for i = 1, n do
  local a, _, p1, p2, p3, cost, flags, demand, tpf, maxt, live_ms, btpf, bmax
  a, _, p1, p2, p3, cost, flags, demand, tpf, maxt, live_ms, btpf, bmax, pos =
    sunpack('>I1I3I4I4I4I8I8I8I4I4I8I4I4', packed, pos)
  local bucket, records = KEYS[2 * i - 1], KEYS[2 * i]
  local subscriber = ARGV[3 + i]
  local alg = (ALGORITHMS[a] or MAKE(a))
  -- The charge: GET (fails with WRONGTYPE on a foreign key), consume.
  local low = flags % 4
  local x = (flags - low) / 4
  local level, stale = alg[READ](rcall('GET', bucket), p1, p2, p3, now)
  local after, ok, changed, stands = alg[CONSUME](level, cost, p1, p2, p3, x)
  if (ok and changed) or ((not ok) and stands) then
    level = after
    put(bucket, alg, level, p1, p2, p3)
  elseif stale then
    put(bucket, alg, level, p1, p2, p3)
  end
  reply[2 * i - 1] = alg[REPORT](level, p1, p2, p3, now)
  if live_ms == 0 then
    -- The subscriber leaves: its record goes, the others stay as they are.
    rcall('HDEL', records, subscriber)
    reply[2 * i] = {}
  else
    reply[2 * i] = record(records, subscriber, demand, tpf, maxt, live_ms, btpf, bmax)
  end
end
return reply
