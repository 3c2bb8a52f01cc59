--[[ token_bucket.lua: the token bucket's part of the request script
(lua/request.lua, which documents the functions every algorithm part returns
and how src/storage/redis/script.rs assembles the script). It implements
exactly the reference model `src/storage/algorithm/token_bucket.rs`
(`TokenBucket`); the Rust tests compare script and model on random inputs.

Units: tokens are micro-tokens (1 token = 1,000,000) and times are
microseconds since the Unix epoch, all integers. Lua numbers are doubles, so
every intermediate value is kept below 2^53 (see the refill formula below).

Limit (the packed charge's parameters):
  p1 = R     tokens added per unit (u32); 0 = capacity 0
  p2 = U     unit length in seconds (1 .. 31,536,000)
  p3 = C     capacity (burst) in tokens (u32)
  x  = D     max_debt in tokens (0 when R = 0). On a bucket with D > 0 a
             consume is always charged, admitted or not, clamped at -D
             (never raised by the clamp): it stands when the request is
             denied.
  cost       clamped by the caller to at most capacity + max_debt + 1 for a
             consume and capacity + 2^32 - 1 (the deepest debt) for a
             refund, which changes no outcome.

Level: the balance in micro-tokens at now (negative while in debt), capped
at the capacity; a missing bucket is full. report(level) is the balance.

Stored state, one string key per bucket (binary, big-endian):
  7 bytes updated_us, then tokens_micro in as few bytes as needed (0..7); a
  negative balance (debt) as a 0 byte, then its magnitude in 1..7 bytes (a
  minimal positive encoding never starts with a 0 byte).
Up to 12 bytes (tokens < 2^40 micro-tokens, about 1.1 million tokens) the value
fits the same allocator class as a small embedded string, so a bucket costs at
most 16 bytes more than a plain integer key of the same name.
Every written key expires (PX) when its bucket would be full again (ceil, at
least 1 ms); a bucket that is full again is deleted (a missing bucket is full).
A stored timestamp after now (Redis's clock stepped back) is taken as now: it
refills nothing and the next write stores now, so a clock step never freezes
a bucket (docs/design.md, "Time").
]]

local MICRO = 1000000
local TWO53 = 9007199254740992
-- Library functions as locals: a local is one VM register, a global a table
-- lookup per use.
local fmod, ceil = math.fmod, math.ceil
local spack, sunpack, sbyte = struct.pack, struct.unpack, string.byte

-- Packing with Redis's built-in `struct` library (one C call instead of a
-- byte loop in Lua). Every value packed is an integer below 2^53, exact in
-- the library's 64-bit integers.
-- PACK[m]: 7 bytes of timestamp, then m bytes of tokens (one call reads or
-- writes both).
local PACK = { [0] = '>I7', '>I7I1', '>I7I2', '>I7I3', '>I7I4', '>I7I5', '>I7I6', '>I7I7', '>I7I8' }

-- The helpers below are written out where they are used, not as functions
-- of their own: the script makes this part's functions on every call that
-- uses it, and each function costs there. Exact integer division of
-- non-negative integers below 2^53 is `r = fmod(a, b); q = (a - r) / b`.

-- `balance` after a debt charge of `cost` tokens on a bucket whose debt
-- bound is `debt` micro-tokens (token_bucket.rs charge_debt): down by the cost,
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

-- Each function below computes the capacity in micro-tokens itself (0
-- when R = 0): inline, a call per use would cost more than the arithmetic.

-- The balance at now of a bucket stored as `s` (false: missing, full), and
-- whether it was stored after now.
local function read(s, R, U, C, now)
  local cap = 0
  if R > 0 then
    cap = C * MICRO
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
    -- The balance at now (token_bucket.rs BucketState::tokens_at). The
    -- refill floor(elapsed * R / U) would exceed 2^53, so it is computed
    -- as q*R + r*a + floor(r*b/U) with q, r = divmod(elapsed, U) and
    -- a, b = divmod(R, U): r*a < R and r*b < U^2 < 2^53, and q*R is only
    -- used when it is below the deficit (else the bucket is full).
    local elapsed = now - updated
    if tokens >= cap then
      tokens = cap
    elseif elapsed > 0 then
      if U == 1 then
        -- Per-second rules, the usual case: q = elapsed, r = 0 below.
        local qr = elapsed * R
        if qr >= cap - tokens then
          tokens = cap
        else
          tokens = tokens + qr
        end
      else
        local r = fmod(elapsed, U)
        local qr = (elapsed - r) / U * R
        if qr >= cap - tokens then
          tokens = cap
        else
          local b = fmod(R, U)
          local rb = r * b
          local rem = fmod(rb, U)
          tokens = tokens + qr + r * ((R - b) / U) + (rb - rem) / U
          if tokens > cap then
            tokens = cap
          end
        end
      end
    end
    return tokens, updated > now
  end
  return cap, false
end

local function rebase(w, R, U, C)
  local cap = 0
  if R > 0 then
    cap = C * MICRO
  end
  if w > cap then
    return cap
  end
  return w
end

-- A consume of `cost` tokens (token_bucket.rs TokenBucket::consume): needs
-- max(cost, 1) tokens, at most capacity + 1; a debt charge (D > 0, cost > 0)
-- is always taken and stands when the request is denied.
local function consume(w, cost, R, U, C, D)
  local cap = 0
  if R > 0 then
    cap = C * MICRO
  end
  local need = cost
  if need < 1 then
    need = 1
  end
  need = need * MICRO
  if need > cap + MICRO then
    need = cap + MICRO
  end
  local ok = w >= need
  if D > 0 then
    if cost > 0 then
      return charge_debt(w, cost, D * MICRO), ok, true, true
    end
  elseif ok and cost > 0 then
    return w - cost * MICRO, ok, true, false
  end
  return w, ok, false, false
end

local function refund(w, cost, R, U, C)
  local cap = 0
  if R > 0 then
    cap = C * MICRO
  end
  local new = w + cost * MICRO
  if new > cap then
    new = cap
  end
  return new, new ~= w
end

local function report(w)
  return w
end

-- Under a rate of 0 (capacity 0) a bucket counts as full, as in the model.
local function encode_state(w, now, R, U, C)
  local cap = 0
  if R > 0 then
    cap = C * MICRO
  end
  if w >= cap or R == 0 then
    return nil
  end
  -- The value: 7 bytes of now, then the balance's magnitude in as few
  -- bytes as it needs (below 2^56; none for 0). A balance in debt is
  -- written in one byte more than it needs, so it starts with a 0 byte,
  -- which a minimal encoding never does.
  local v = w
  if w < 0 then
    v = -w
  end
  local m
  if v < 4294967296 then
    if v < 65536 then
      if v == 0 then
        m = 0
      elseif v < 256 then
        m = 1
      else
        m = 2
      end
    elseif v < 16777216 then
      m = 3
    else
      m = 4
    end
  elseif v < 1099511627776 then
    m = 5
  elseif v < 281474976710656 then
    m = 6
  else
    m = 7
  end
  local value
  if w < 0 then
    value = spack(PACK[m + 1], now, v)
  elseif m == 0 then
    value = spack('>I7', now)
  else
    value = spack(PACK[m], now, v)
  end
  -- Milliseconds until the bucket is full (ceil, at least 1; the driver
  -- applies its bounds).
  local p = (cap - w) * U
  local ms
  if p < TWO53 then
    local rem = fmod(p, R)
    local us = (p - rem) / R
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
    ms = ceil((cap - w) / R * U / 1000 * (1 + 1e-9)) + 1
  end
  if ms < 1 then
    ms = 1
  end
  return value, ms
end

-- Whether encode_state stores a value (a bucket below its capacity under a
-- rate above 0). A stored balance read at the time it was stamped has not
-- refilled: read gives min(balance, capacity), which is rebase.
local function kept(w, R, U, C)
  return R > 0 and w < C * MICRO
end

-- A settlement of `cost` tokens (reservation.rs settle) against a
-- reservation holding `held` tokens (false: none open): the excess over
-- the estimate is charged (debt semantics, clamped at -D and never raised
-- by the clamp), the rest given back (never above the capacity); without
-- a reservation the whole cost is charged the same way.
local function settle(w, held, cost, R, U, C, D)
  local debt = 0
  if R > 0 then
    debt = D * MICRO
  end
  if held and cost < held then
    local cap = 0
    if R > 0 then
      cap = C * MICRO
    end
    local new = w + (held - cost) * MICRO
    if new > cap then
      new = cap
    end
    if new < w then
      new = w
    end
    return new
  end
  if held then
    cost = cost - held
  end
  return charge_debt(w, cost, debt)
end

-- `times` plain consumes of `cost` in a row from the balance w, each
-- exactly as consume above, each starting from what the one before it
-- left (every balance a charge writes under a rate above 0 is kept)
-- (lua/request.lua, run): a batch's hot bucket without a function call
-- per request. Appends each request's admitted,
-- enough and left to V after nv; returns the balance after, the new nv and
-- how many requests wrote the bucket (all of them with a debt bound; else
-- up to the first denied, which writes nothing; none for a check).
local function run(w, cost, R, U, C, D, times, V, nv)
  local cap = 0
  if R > 0 then
    cap = C * MICRO
  end
  local need = cost
  if need < 1 then
    need = 1
  end
  need = need * MICRO
  if need > cap + MICRO then
    need = cap + MICRO
  end
  if cost == 0 then
    -- A check changes nothing.
    local ok = 0
    if w >= need then
      ok = 1
    end
    V[nv + 1], V[nv + 2], V[nv + 3] = ok, ok, w
    return w, nv + 3, 0
  end
  local take = cost * MICRO
  if D > 0 then
    -- Every charge is taken, clamped at -D (charge_debt), and stands.
    local bound = -D * MICRO
    for _ = 1, times do
      local floor = bound
      if floor > w then
        floor = w
      end
      local after = w - take
      if after < floor then
        after = floor
      end
      if w >= need then
        V[nv + 1], V[nv + 2], V[nv + 3] = 1, 1, after
      else
        V[nv + 1], V[nv + 2], V[nv + 3] = 0, 0, w
      end
      nv = nv + 3
      -- (Under a rate of 0 nothing is kept: the next charge finds the
      -- bucket full, as a missing one. The caller never sends a debt
      -- bound with a rate of 0; the line keeps run equal to consume.)
      if R > 0 then
        w = after
      else
        w = cap
      end
    end
    return w, nv, times
  end
  for i = 1, times do
    if w < need then
      V[nv + 1], V[nv + 2], V[nv + 3] = 0, 0, w
      return w, nv + 3, i - 1
    end
    w = w - take
    V[nv + 1], V[nv + 2], V[nv + 3] = 1, 1, w
    nv = nv + 3
  end
  return w, nv, times
end

-- For a run of identical requests of several charges (lua/request.lua,
-- steps): how many plain consumes of `cost` in a row fit from the balance
-- w, each taking `take` micro-tokens (every one of them as consume: enough,
-- changed, not standing; the balance it leaves is below the capacity, so
-- kept, and reported as itself), the next one not having enough and
-- changing nothing. nil for a check (it takes nothing) and on a bucket with
-- a debt bound (every charge stands).
local function steps(w, cost, R, U, C, D)
  if D > 0 or cost == 0 then
    return nil
  end
  local cap = 0
  if R > 0 then
    cap = C * MICRO
  end
  local take = cost * MICRO
  -- A cost above capacity + 1 needs capacity + 1 tokens: never there.
  if w < take or take > cap + MICRO then
    return 0, take
  end
  return (w - fmod(w, take)) / take, take
end

-- In the order of lua/request.lua's contract (an array: cheaper to build
-- on every call than a table with named fields); the eighth, settle, is
-- the token bucket's alone (reservations), as are the ninth, run, and the
-- tenth, steps.
return { read, rebase, consume, refund, report, encode_state, kept, settle, run, steps }
