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
-- Library functions as locals: a local is one VM register, a global a table
-- lookup per use.
local fmod, ceil, rcall = math.fmod, math.ceil, redis.call
local spack, sunpack, sbyte = struct.pack, struct.unpack, string.byte

-- Exact integer division of non-negative integers below 2^53.
local function divmod(a, b)
  local r = fmod(a, b)
  return (a - r) / b, r
end

-- Packing with Redis's built-in `struct` library (one C call instead of a
-- byte loop in Lua). Every value packed is an integer below 2^53, exact in
-- the library's 64-bit integers.
-- PACK[m]: 7 bytes of timestamp, then m bytes of tokens (one call reads or
-- writes both).
local PACK = { [0] = '>I7', '>I7I1', '>I7I2', '>I7I3', '>I7I4', '>I7I5', '>I7I6', '>I7I7', '>I7I8' }

-- Bytes needed for a magnitude below 2^56 (0 for 0).
local function width(v)
  if v < 4294967296 then
    if v < 65536 then
      if v == 0 then
        return 0
      elseif v < 256 then
        return 1
      end
      return 2
    elseif v < 16777216 then
      return 3
    end
    return 4
  elseif v < 1099511627776 then
    return 5
  elseif v < 281474976710656 then
    return 6
  end
  return 7
end

-- A balance in debt is written as its magnitude in one byte more than it
-- needs, so it starts with a 0 byte, which a minimal encoding never does.
local function encode(tokens, updated)
  if tokens < 0 then
    return spack(PACK[width(-tokens) + 1], updated, -tokens)
  end
  local m = width(tokens)
  if m == 0 then
    return spack('>I7', updated)
  end
  return spack(PACK[m], updated, tokens)
end

-- Micro-tokens at `now` (bucket.rs BucketState::tokens_at). The refill
-- floor(elapsed * R / U) would exceed 2^53, so it is computed as
-- q*R + r*a + floor(r*b/U) with q, r = divmod(elapsed, U) and
-- a, b = divmod(R, U): r*a < R and r*b < U^2 < 2^53, and q*R is only used
-- when it is below the deficit (else the bucket is full).
local function tokens_at(have, updated, R, U, cap, now)
  if have >= cap then
    return cap
  end
  local elapsed = now - updated
  if elapsed <= 0 then
    return have
  end
  if U == 1 then
    -- Per-second rules, the usual case: q = elapsed, r = 0 below.
    local qr = elapsed * R
    if qr >= cap - have then
      return cap
    end
    return have + qr
  end
  local q, r = divmod(elapsed, U)
  local qr = q * R
  if qr >= cap - have then
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

-- `balance` after a debt charge of `cost` tokens on a bucket whose debt
-- bound is `debt` micro-tokens (bucket.rs charge_debt): down by the cost,
-- clamped at -debt, never raised by the clamp.
local function charge_debt(balance, cost, debt)
  local floor = -debt
  if floor > balance then
    floor = balance
  end
  local after = balance - cost * MICRO
  if after < floor then
    return floor
  end
  return after
end

-- Milliseconds until a bucket holding `tokens` (of `cap`; negative in
-- debt) is full (ceil, at least 1).
local function ttl_ms(R, U, cap, tokens)
  local p = (cap - tokens) * U
  local ms
  if p < TWO53 then
    local us, rem = divmod(p, R)
    if rem > 0 then
      us = us + 1
    end
    local rr = fmod(us, 1000)
    ms = (us - rr) / 1000
    if rr > 0 then
      ms = ms + 1
    end
  else
    -- Years-long waits: doubles with an upward margin.
    ms = ceil((cap - tokens) / R * U / 1000 * (1 + 1e-9)) + 1
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
  local t = rcall('TIME')
  now = tonumber(t[1]) * MICRO + tonumber(t[2])
end

-- Every bucket in one MGET (in slices, to stay inside Lua's stack for a
-- request with very many descriptors). MGET reads a key of another type as
-- missing, so a key it reports missing is read again with GET, which fails
-- with WRONGTYPE on a foreign key instead of letting it be overwritten; a
-- hot bucket exists, so that second read is paid by new buckets only.
local nk = #KEYS
local vals
if nk == 0 then
  vals = {}
elseif nk <= 512 then
  vals = rcall('MGET', unpack(KEYS))
else
  vals = {}
  for i = 1, nk, 512 do
    local j = i + 511
    if j > nk then
      j = nk
    end
    local part = rcall('MGET', unpack(KEYS, i, j))
    for x = 1, j - i + 1 do
      vals[i + x - 1] = part[x]
    end
  end
end

-- Per bucket k (index into KEYS): the stored balance ST[k] and stamp SU[k]
-- (SU[k] false: missing, a full bucket), the working balance W[k] and
-- whether it changed (DIRTY[k]), the limit of its last charge (LR, LU, LC),
-- for debt buckets the balance after the debt charges only (DW[k], written
-- when the request is denied), and for a bucket stamped after now the
-- balance read before any charge (READ[k]).
local ST, SU, W, DIRTY, LR, LU, LC, DW, READ = {}, {}, {}, {}, {}, {}, {}, {}, {}
-- Per charge: its bucket and whether it had enough tokens.
local KEY, ENOUGH = {}, {}

-- ARGV[3]: the charges (see the header), taken in order.
local packed = ARGV[3]
local n = #packed / 32
local admitted = true
local pos = 1
for c = 1, n do
  local k, R, U, C, cost, flags
  k, R, U, C, cost, flags, pos = sunpack('>I4I4I4I4I8I8', packed, pos)
  KEY[c] = k
  -- Exact: flags < 2^35 and the divisors are powers of two.
  local low = flags % 4
  local refund = low % 2 == 1
  local shadow = low >= 2
  local debt = (flags - low) / 4 * MICRO
  local cap = 0
  if R > 0 then
    cap = C * MICRO
  end
  local w = W[k]
  if w == nil then
    local s = vals[k]
    if not s then
      -- Missing, or another type: GET tells them apart (WRONGTYPE).
      s = rcall('GET', KEYS[k])
    end
    local len = s and #s or 0
    if len >= 7 and len <= 15 then
      local updated, tokens
      if len == 7 then
        updated, tokens = sunpack('>I7', s), 0
      else
        local m = len - 7
        updated, tokens = sunpack(PACK[m], s)
        -- The first of its m bytes is 0: a debt.
        if sbyte(s, 8) == 0 then
          tokens = -tokens
        end
      end
      ST[k], SU[k] = tokens, updated
      w = tokens_at(tokens, updated, R, U, cap, now)
      if updated > now then
        READ[k] = w
      end
    else
      SU[k] = false
      w = cap
    end
    DIRTY[k] = false
  end
  -- A later charge on the same bucket may carry another limit.
  if w > cap then
    w = cap
  end
  LR[k], LU[k], LC[k] = R, U, cap
  if refund then
    local new = w + cost * MICRO
    if new > cap then
      new = cap
    end
    if new ~= w then
      w = new
      DIRTY[k] = true
    end
    ENOUGH[c] = 1
  else
    local need = cost
    if need < 1 then
      need = 1
    end
    need = need * MICRO
    if need > cap + MICRO then
      need = cap + MICRO
    end
    local ok = w >= need
    if ok then
      ENOUGH[c] = 1
    else
      ENOUGH[c] = 0
      if not shadow then
        admitted = false
      end
    end
    if debt > 0 then
      if cost > 0 then
        w = charge_debt(w, cost, debt)
        DIRTY[k] = true
        local d = DW[k]
        if d == nil then
          d = cap
          if SU[k] then
            d = tokens_at(ST[k], SU[k], R, U, cap, now)
          end
        elseif d > cap then
          d = cap
        end
        DW[k] = charge_debt(d, cost, debt)
      end
    elseif ok and cost > 0 then
      w = w - cost * MICRO
      DIRTY[k] = true
    end
  end
  W[k] = w
end

-- Writes the balance `tokens` of bucket k, stamped now. Under a rate of 0
-- (capacity 0) a bucket counts as full, as in the model.
local function put(k, tokens)
  local cap = LC[k]
  if tokens >= cap or LR[k] == 0 then
    rcall('DEL', KEYS[k])
  else
    rcall('SET', KEYS[k], encode(tokens, now), 'PX', string.format('%d', ttl_ms(LR[k], LU[k], cap, tokens)))
  end
end

-- A bucket stamped after now (Redis's clock stepped back) that nothing
-- else writes is written as read, stamped now, admitted or not: otherwise
-- every later call would read "no time elapsed" until the clock caught up.
-- (`DIRTY` has every bucket of the request as a key.)
local reply = { 0 }
if admitted then
  reply[1] = 1
  for k, d in pairs(DIRTY) do
    if d then
      put(k, W[k])
    elseif READ[k] then
      put(k, READ[k])
    end
  end
  for c = 1, n do
    reply[2 * c] = ENOUGH[c]
    reply[2 * c + 1] = W[KEY[c]]
  end
else
  for k in pairs(DIRTY) do
    if DW[k] then
      put(k, DW[k])
    elseif READ[k] then
      put(k, READ[k])
    end
  end
  -- Balances before the request, under each charge's own limit.
  pos = 1
  for c = 1, n do
    local k, R, U, C
    k, R, U, C = sunpack('>I4I4I4I4', packed, pos)
    pos = pos + 32
    local cap = 0
    if R > 0 then
      cap = C * MICRO
    end
    local t = cap
    if SU[k] then
      t = tokens_at(ST[k], SU[k], R, U, cap, now)
    end
    reply[2 * c] = ENOUGH[c]
    reply[2 * c + 1] = t
  end
end
if n == 1 then
  return spack('>BBi8', reply[1], reply[2], reply[3])
end
return spack('>B' .. string.rep('Bi8', n), unpack(reply))
