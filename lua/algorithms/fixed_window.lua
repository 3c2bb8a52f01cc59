--[[ fixed_window.lua: the fixed window's part of the request script
(lua/request.lua, which documents the functions every algorithm part returns
and how src/storage/redis/script.rs assembles the script). It implements
exactly the reference model `src/storage/algorithm/fixed_window.rs`
(`FixedWindow`): the Go reference service's windows, aligned to the unit
since the Unix epoch; the Rust tests compare script and model on random
inputs.

Units: counts are whole tokens, times microseconds since the Unix epoch, all
integers below 2^53 (a count is saturated at MAX_COUNT, about 2^33).

Limit (the packed charge's parameters):
  p1 = N     tokens per window (u32)
  p2 = U     window length in seconds (1 .. 31,536,000)
  p3 = F     1: a consume that does not fit is counted anyway and stands
             when the request is denied (the Go service counts a denied
             request's hits); 0: it is not
  x          a refund's target: 0 = the window of now; else the number of
             the window the charge it gives back was counted in, plus 1 (a
             Redis Cluster compensation): nothing is given back once that
             window is over.
  cost       clamped by the caller to at most MAX_COUNT, which changes no
             outcome.

Level: the count of the window of now (a missing key counts 0).
report(level) is N - count in micro-tokens (negative while the window is
over its limit), with a window report (the previous window's count: 0).

Stored state, one string key per window (binary, big-endian), 20 bytes:
  1 byte 241 (the format's tag), 7 bytes updated_us, 4 bytes U, 8 bytes the
  count. The token bucket reads any value longer than 15 bytes as missing,
  and this part reads anything but its own format (a bucket, a key written
  under another unit) as missing, so a rule whose algorithm or unit a
  reload changes starts afresh. A state of a later window than now's (Redis's
  clock stepped back) is taken as now's, and written again stamped now.
Every written key expires (PX) at the end of its window (ceil, at least
1 ms); a count of 0 is deleted.
]]

local MICRO = 1000000
-- Twice the largest N: a window that far over is over for every limit.
local MAX_COUNT = 8589934590
local TAG = 241
local FORMAT = '>BI7I4I8'
local fmod = math.fmod
local spack, sunpack, sbyte = struct.pack, struct.unpack, string.byte

-- The number of the window of t (microseconds) for windows of w
-- microseconds: exact, t and w being integers below 2^53.
local function index(t, w)
  return (t - fmod(t, w)) / w
end

local function read(s, N, U, F, now)
  if s and #s == 20 and sbyte(s, 1) == TAG then
    local _, updated, unit, count = sunpack(FORMAT, s)
    if unit == U then
      local w = U * MICRO
      if index(updated, w) >= index(now, w) then
        return count, updated > now
      end
    end
  end
  return 0, false
end

-- A count reached under the limit (qN, qU, qF): the same window when the
-- unit is the same, else a new one.
local function rebase(count, N, U, F, qN, qU, qF)
  if qU == U then
    return count
  end
  return 0
end

-- A consume of `cost` tokens (fixed_window.rs FixedWindow::consume): fits
-- while count + cost <= N (a check, cost 0, while count <= N); one that does
-- not fit is counted with F = 1, and stands.
local function consume(count, cost, N, U, F, x)
  local after = count + cost
  local ok = after <= N
  if cost == 0 then
    return count, ok, false, false
  end
  if after > MAX_COUNT then
    after = MAX_COUNT
  end
  if ok then
    return after, true, true, false
  end
  if F == 1 then
    return after, false, true, true
  end
  return count, false, false, false
end

local function refund(count, cost, N, U, F, x, now)
  if x > 0 and x - 1 ~= index(now, U * MICRO) then
    return count, false
  end
  local new = count - cost
  if new < 0 then
    new = 0
  end
  return new, new ~= count
end

local function report(count, N, U, F, now)
  return (N - count) * MICRO, 0
end

local function encode_state(count, now, N, U, F)
  if count <= 0 then
    return nil
  end
  local w = U * MICRO
  local left = w - fmod(now, w)
  local rem = fmod(left, 1000)
  local ms = (left - rem) / 1000
  if rem > 0 then
    ms = ms + 1
  end
  return spack(FORMAT, TAG, now, U, count), ms
end

local function kept(count, N, U, F)
  return count > 0
end

return { read, rebase, consume, refund, report, encode_state, kept }
