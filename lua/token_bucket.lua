--[[ token_bucket.lua: evaluate and charge every token bucket of one
ShouldRateLimit request, atomically.

Why a script: the design (docs/design.md, "All-or-nothing requests") requires all-or-nothing per request (if any non-shadow
descriptor lacks tokens, no bucket is charged) under concurrency, and docs/design.md, "Redis script",
requires one round trip per request. A Lua script runs atomically inside Redis
and reads every bucket, decides, and writes in one call. It implements exactly
the reference model `src/limiter/bucket.rs` (`apply_request`); the Rust tests
compare the two on random inputs.

Units: tokens are micro-tokens (1 token = 1,000,000) and times are
microseconds since the Unix epoch, all integers. Lua numbers are doubles, so
every intermediate value is kept below 2^53 (see the refill formula below).

KEYS[1..k]  distinct bucket keys of the request (one per bucket).
ARGV[1]     explicit now in microseconds, TESTS ONLY; the service always sends
            "" and time comes from redis.call('TIME'), so service replicas with
            skewed clocks can never mint tokens (docs/design.md, "Time").
ARGV[2]     shortest expiry in milliseconds, TESTS ONLY ("" = none): with an
            explicit (paused) now, Redis still expires keys in real time, so
            test runs keep buckets alive for longer than their time to full.
ARGV[3]     every charge, in request order, packed as one binary string of
            32 bytes per charge, big-endian unsigned: key index (4 bytes),
            R (4), U (4), C (4), cost (8), flags (8). (One packed argument
            instead of six decimal strings per charge: the client builds no
            strings and the script runs no `tonumber` per value.) The values:
              key index  1-based index into KEYS
              R          tokens added per unit (u32); 0 = capacity 0
              U          unit length in seconds (1 .. 31,536,000)
              C          capacity (burst) in tokens (u32)
              cost       tokens; already clamped by the caller to at most
                         capacity + max_debt + 1 for a consume and
                         capacity + 2^32 - 1 (the deepest debt) for a
                         refund, which changes no outcome; 0 = check only
              flags      bit 0: refund (is_negative_hits), bit 1: shadow mode,
                         flags / 4 (floor): max_debt D in tokens (0 when
                         R = 0). On a bucket with D > 0 a consume is always
                         charged, admitted or not, clamped at -D (never
                         raised by the clamp); when the request is denied,
                         only those debt charges are written.

Reply: one binary string, big-endian, 1 + 9 n bytes:
  admitted   1 byte: 1 if every non-shadow consume charge had enough tokens
             (then all were charged), else 0 (then only debt charges were
             written).
  then per charge i, in request order:
  enough_i   1 byte: 1 if charge i had enough tokens (always 1 for a refund).
  tokens_i   8 bytes, signed: micro-tokens in charge i's bucket after the
             request (admitted) or before it (not admitted), under charge
             i's limit; negative while in debt.
(One packed string instead of an array of 2n + 1 integers: the client parses
it in a few instructions, where an array of integers costs a parser step per
element.)
Durations and remaining counts are computed by the caller from these.

Stored state, one string key per bucket (binary, big-endian):
  7 bytes updated_us, then tokens_micro in as few bytes as needed (0..7); a
  negative balance (debt) as a 0 byte, then its magnitude in 1..7 bytes (a
  minimal positive encoding never starts with a 0 byte).
Up to 12 bytes (tokens < 2^40 micro-tokens, about 1.1 million tokens) the value
fits the same allocator class as a small embedded string, so a bucket costs at
most 16 bytes more than a plain integer key of the same name.
Every written key expires (PX) when its bucket would be full again (ceil, at
least 1 ms); a bucket that is full again is deleted (a missing bucket is full).
A check (cost 0), a refund on a full bucket and a denied request write nothing
and refresh no TTL. A stored timestamp after now (Redis's clock stepped
back) is taken as now: it refills nothing and the next write stores now, so a
clock step never freezes a bucket (docs/design.md, "Time").
]]

local MICRO = 1000000
local TWO53 = 9007199254740992
-- Longest expiry written, in ms (about 31,700 years): keeps now + PX inside
-- Redis's 64-bit millisecond clock; such buckets are never full in practice.
local MAX_TTL_MS = 1000000000000000
-- ARGV[2]: shortest expiry for test runs (0 = none).
local min_ttl = tonumber(ARGV[2]) or 0

-- Exact integer division of non-negative integers below 2^53.
local function divmod(a, b)
  local r = math.fmod(a, b)
  return (a - r) / b, r
end

-- Integers are formatted by hand: Lua's default number formatting may use an
-- exponent, which Redis rejects as an integer argument.
local function int(n)
  return string.format('%.0f', n)
end

-- Packing with Redis's built-in `struct` library (one C call instead of a
-- byte loop in Lua: most of the script's time per bucket went there). Every
-- value packed is an integer below 2^53, exact in the library's 64-bit integers.
-- PACK[m]: 7 bytes of timestamp, then m bytes of tokens (one call reads or
-- writes both).
local PACK = { [0] = '>I7', '>I7I1', '>I7I2', '>I7I3', '>I7I4', '>I7I5', '>I7I6', '>I7I7', '>I7I8' }
-- POW[i] = 256^i: a value below POW[m] fits in m bytes.
local POW = { [0] = 1, 256, 65536, 16777216, 4294967296, 1099511627776, 281474976710656, 72057594037927936 }

-- A balance in debt is written as its magnitude in one byte more than it
-- needs, so it starts with a 0 byte, which a minimal encoding never does.
local function encode(tokens, updated)
  local neg = tokens < 0
  if neg then
    tokens = -tokens
  end
  local m = 0
  while tokens >= POW[m] do
    m = m + 1
  end
  if neg then
    m = m + 1
  end
  if m == 0 then
    return struct.pack(PACK[0], updated)
  end
  return struct.pack(PACK[m], updated, tokens)
end

-- Returns { tokens_micro, updated_us } or nil for a missing (full) bucket.
local function decode(s)
  if not s then
    return nil
  end
  local len = #s
  if len < 7 or len > 15 then
    return nil
  end
  if len == 7 then
    local updated = struct.unpack('>I7', s)
    return { 0, updated }
  end
  local m = len - 7
  local updated, tokens = struct.unpack(PACK[m], s)
  -- Below 256^(m-1): the first of its m bytes is 0, a debt.
  if tokens < POW[m - 1] then
    tokens = -tokens
  end
  return { tokens, updated }
end

-- Micro-tokens at `now` (bucket.rs BucketState::tokens_at). The refill
-- floor(elapsed * R / U) would exceed 2^53, so it is computed as
-- q*R + r*a + floor(r*b/U) with q, r = divmod(elapsed, U) and
-- a, b = divmod(R, U): r*a < R and r*b < U^2 < 2^53, and q*R is only used
-- when it is below the deficit (else the bucket is full).
local function tokens_at(tokens, updated, R, U, cap, now)
  local have = tokens
  if have >= cap then
    return cap
  end
  local elapsed = now - updated
  if elapsed <= 0 then
    return have
  end
  local deficit = cap - have
  local q, r = divmod(elapsed, U)
  local qr = q * R
  if qr >= deficit then
    return cap
  end
  local a, b = divmod(R, U)
  local frac = divmod(r * b, U)
  local t = have + qr + r * a + frac
  if t > cap then
    t = cap
  end
  return t
end

-- Milliseconds until a bucket holding `tokens` (of `cap`; negative in
-- debt) is full (ceil, at least 1).
local function ttl_ms(R, U, cap, tokens)
  local deficit = cap - tokens
  local p = deficit * U
  local ms
  if p < TWO53 then
    local us, rem = divmod(p, R)
    if rem > 0 then
      us = us + 1
    end
    local m, rr = divmod(us, 1000)
    if rr > 0 then
      m = m + 1
    end
    ms = m
  else
    -- Years-long waits: doubles with an upward margin.
    ms = math.ceil(deficit / R * U / 1000 * (1 + 1e-9)) + 1
  end
  if ms < 1 then
    ms = 1
  end
  if ms < min_ttl then
    ms = min_ttl
  end
  if ms > MAX_TTL_MS then
    ms = MAX_TTL_MS
  end
  return ms
end

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * MICRO + tonumber(t[2])
end

-- ARGV[3]: the charges, unpacked once (see the header).
local CHARGE_BYTES = 32
local n = #ARGV[3] / CHARGE_BYTES
local KEY, RATE, UNIT, CAP, COST, FLAGS = {}, {}, {}, {}, {}, {}
do
  local pos = 1
  for c = 1, n do
    KEY[c], RATE[c], UNIT[c], CAP[c], COST[c], FLAGS[c], pos =
      struct.unpack('>I4I4I4I4I8I8', ARGV[3], pos)
  end
end
local stored, work, dirty, last = {}, {}, {}, {}
-- Per debt bucket: the balance after its debt charges only (written when
-- the request is denied), and whether it changed.
local dwork, ddirty = {}, {}
-- Per bucket stamped after now: the balance read before any charge.
local read = {}
local enough = {}
local admitted = true

for c = 1, n do
  local k = KEY[c]
  local R = RATE[c]
  local U = UNIT[c]
  local C = CAP[c]
  local cost = COST[c]
  local flags = FLAGS[c]
  local refund = math.fmod(flags, 2) == 1
  local shadow = flags >= 2
  local debt = 0
  if flags >= 4 then
    local low = math.fmod(flags, 4)
    shadow = low >= 2
    debt = (flags - low) / 4 * MICRO
  end
  local cap = 0
  if R > 0 then
    cap = C * MICRO
  end
  if work[k] == nil then
    -- GET, not MGET: a key of another type under the prefix must fail with
    -- WRONGTYPE instead of reading as a missing bucket and being overwritten.
    local s = decode(redis.call('GET', KEYS[k]))
    stored[k] = s or false
    if s then
      work[k] = tokens_at(s[1], s[2], R, U, cap, now)
      if s[2] > now then
        read[k] = work[k]
      end
    else
      work[k] = cap
    end
    dirty[k] = false
  end
  -- A later charge on the same bucket may carry another limit.
  if work[k] > cap then
    work[k] = cap
  end
  last[k] = { R, U, cap }
  if refund then
    local new = work[k] + cost * MICRO
    if new > cap then
      new = cap
    end
    if new ~= work[k] then
      work[k] = new
      dirty[k] = true
    end
    enough[c] = 1
  else
    local need = cost
    if need < 1 then
      need = 1
    end
    need = need * MICRO
    if need > cap + MICRO then
      need = cap + MICRO
    end
    local ok = work[k] >= need
    if ok then
      enough[c] = 1
    else
      enough[c] = 0
      if not shadow then
        admitted = false
      end
    end
    if debt > 0 then
      if cost > 0 then
        -- Always charged, clamped at -D, never raised by the clamp.
        local t = work[k]
        local floor = -debt
        if floor > t then
          floor = t
        end
        t = t - cost * MICRO
        if t < floor then
          t = floor
        end
        work[k] = t
        dirty[k] = true
        local d = dwork[k]
        if d == nil then
          d = cap
          local s = stored[k]
          if s then
            d = tokens_at(s[1], s[2], R, U, cap, now)
          end
        elseif d > cap then
          d = cap
        end
        floor = -debt
        if floor > d then
          floor = d
        end
        d = d - cost * MICRO
        if d < floor then
          d = floor
        end
        dwork[k] = d
        ddirty[k] = true
      end
    elseif ok and cost > 0 then
      work[k] = work[k] - cost * MICRO
      dirty[k] = true
    end
  end
end

-- Writes the balance `tokens` of bucket k, stamped now. Under a rate of 0
-- (capacity 0) a bucket counts as full, as in the model.
local function put(k, tokens)
  local L = last[k]
  if tokens >= L[3] or L[1] == 0 then
    redis.call('DEL', KEYS[k])
  else
    local px = ttl_ms(L[1], L[2], L[3], tokens)
    redis.call('SET', KEYS[k], encode(tokens, now), 'PX', int(px))
  end
end

-- A bucket stamped after now (Redis's clock stepped back) that nothing
-- else writes is written as read, stamped now, admitted or not: otherwise
-- every later call would read "no time elapsed" until the clock caught up.
-- (`dirty` has every bucket of the request as a key.)
local reply = { 0 }
if admitted then
  reply[1] = 1
  for k, d in pairs(dirty) do
    if d then
      put(k, work[k])
    elseif read[k] then
      put(k, read[k])
    end
  end
  for c = 1, n do
    reply[2 * c] = enough[c]
    reply[2 * c + 1] = work[KEY[c]]
  end
else
  for k in pairs(dirty) do
    if ddirty[k] then
      put(k, dwork[k])
    elseif read[k] then
      put(k, read[k])
    end
  end
  for c = 1, n do
    local k = KEY[c]
    local R = RATE[c]
    local cap = 0
    if R > 0 then
      cap = CAP[c] * MICRO
    end
    local t = cap
    local s = stored[k]
    if s then
      t = tokens_at(s[1], s[2], R, UNIT[c], cap, now)
    end
    reply[2 * c] = enough[c]
    reply[2 * c + 1] = t
  end
end
return struct.pack('>B' .. string.rep('Bi8', n), unpack(reply))
