--[[ sliding_window.lua: the sliding window counter's part of the request
script (lua/request.lua, which documents the functions every algorithm part
returns and how src/storage/redis/script.rs assembles the script). It
implements exactly the reference model
`src/storage/algorithm/sliding_window.rs` (`SlidingWindow`); the Rust tests
compare script and model on random inputs.

Units: counts are whole tokens, amounts micro-tokens, times microseconds
since the Unix epoch, all integers below 2^53 (counts saturate at 2^32, so
that every amount below is exact).

Limit (the packed charge's parameters):
  p1 = N     tokens per window (u32)
  p2 = U     window length in seconds (1 .. 31,536,000); windows are aligned
             to U since the Unix epoch
  p3 = F     1: a consume that does not fit is counted anyway and stands
             (the quota service's charges); 0: it is not
  x          a refund's target: 0 = the window of now; else the number of
             the window the charge it gives back was counted in, plus 1 (a
             Redis Cluster compensation): the previous window's count when
             that is the one, nothing when it is older.
  cost       clamped by the caller (at most 2^33), which changes no outcome.

Level: a table { prev, cur, r }: the previous and the current window's
counts at now and r, the microseconds from now to the end of the window
(the previous window's part still inside the sliding window ending now is
r / (U × 10^6)). The estimate is ceil(prev × r / U) micro-tokens plus
cur × 10^6. report(level) is N × 10^6 minus the estimate, with a window
report (prev × 10^6).

Stored state, one string key per window (binary, big-endian), 28 bytes:
  1 byte 242 (the format's tag), 7 bytes updated_us, 4 bytes U, 8 bytes
  prev, 8 bytes cur. Anything else (a bucket, a fixed window, a key written
  under another unit) reads as missing. Written in the window before now's,
  its cur is now's prev; earlier, it is missing. A state of a later window
  than now's (Redis's clock stepped back) is taken as now's, and written
  again stamped now.
Every written key expires (PX) at the end of the next window while cur > 0
(the count is the previous one until then), at the end of its window while
only prev > 0 (ceil, at least 1 ms); with both 0 it is deleted.
]]

local MICRO = 1000000
local MAX_COUNT = 4294967296
local TAG = 242
local FORMAT = '>BI7I4I8I8'
local fmod = math.fmod
local spack, sunpack, sbyte = struct.pack, struct.unpack, string.byte

-- Exact integer division of non-negative integers below 2^53.
local function divmod(a, b)
  local r = fmod(a, b)
  return (a - r) / b, r
end

-- The number of the window of t for windows of w microseconds.
local function index(t, w)
  return (t - fmod(t, w)) / w
end

-- ceil(prev × r / U) (sliding_window.rs weighted_micro), exactly: with
-- r = a·U + b and prev = c·U + d it is prev·a + c·b + ceil(d·b / U), where
-- prev·a <= prev·10^6 < 2^53 and d·b < U^2 < 2^53.
local function weighted(prev, r, U)
  if prev == 0 then
    return 0
  end
  local a, b = divmod(r, U)
  local c, d = divmod(prev, U)
  local q, rem = divmod(d * b, U)
  if rem > 0 then
    q = q + 1
  end
  return prev * a + c * b + q
end

local function read(s, N, U, F, now)
  local w = U * MICRO
  local r = w - fmod(now, w)
  if s and #s == 28 and sbyte(s, 1) == TAG then
    local _, updated, unit, prev, cur = sunpack(FORMAT, s)
    if unit == U then
      local ks, kn = index(updated, w), index(now, w)
      if ks >= kn then
        return { prev, cur, r }, updated > now
      end
      if ks + 1 == kn then
        return { cur, 0, r }, false
      end
    end
  end
  return { 0, 0, r }, false
end

-- A level reached under the limit (qN, qU, qF): the same windows when the
-- unit is the same, else new ones.
local function rebase(l, N, U, F, qN, qU, qF)
  if qU == U then
    return l
  end
  return { 0, 0, 0 }
end

-- A consume of `cost` tokens (sliding_window.rs SlidingWindow::consume):
-- needs max(cost, 1) tokens, at most N + 1; fits while the estimate plus
-- the need is at most N (compared as cur + need <= N - weighted, every
-- side exact).
local function consume(l, cost, N, U, F, x)
  local prev, cur, r = l[1], l[2], l[3]
  local cap = N * MICRO
  local need = cost
  if need < 1 then
    need = 1
  end
  need = need * MICRO
  if need > cap + MICRO then
    need = cap + MICRO
  end
  local ok = cur * MICRO + need <= cap - weighted(prev, r, U)
  if cost == 0 then
    return l, ok, false, false
  end
  if ok or F == 1 then
    local after = cur + cost
    if after > MAX_COUNT then
      after = MAX_COUNT
    end
    return { prev, after, r }, ok, true, not ok
  end
  return l, false, false, false
end

local function refund(l, cost, N, U, F, x, now)
  local prev, cur, r = l[1], l[2], l[3]
  if x > 0 then
    local kn = index(now, U * MICRO)
    if x == kn then
      -- Taken in the previous window: its count is prev now.
      local new = prev - cost
      if new < 0 then
        new = 0
      end
      if new == prev then
        return l, false
      end
      return { new, cur, r }, true
    elseif x - 1 ~= kn then
      return l, false
    end
  end
  local new = cur - cost
  if new < 0 then
    new = 0
  end
  if new == cur then
    return l, false
  end
  return { prev, new, r }, true
end

local function report(l, N, U, F, now)
  return N * MICRO - weighted(l[1], l[3], U) - l[2] * MICRO, l[1] * MICRO
end

local function encode_state(l, now, N, U, F)
  local prev, cur = l[1], l[2]
  if prev <= 0 and cur <= 0 then
    return nil
  end
  local w = U * MICRO
  local left = w - fmod(now, w)
  if cur > 0 then
    left = left + w
  end
  local ms, rem = divmod(left, 1000)
  if rem > 0 then
    ms = ms + 1
  end
  return spack(FORMAT, TAG, now, U, prev, cur), ms
end

local function kept(l, N, U, F)
  return l[1] > 0 or l[2] > 0
end

return { read, rebase, consume, refund, report, encode_state, kept }
