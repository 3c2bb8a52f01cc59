--[[ request.lua: evaluate and charge every limit of one ShouldRateLimit
request, atomically, whatever algorithm each limit uses; or of each request
of a batch in turn, each exactly as if it came alone.

Why a script: the design (docs/design.md, "All-or-nothing requests") requires all-or-nothing per request (if any non-shadow
descriptor lacks tokens, no key is charged) under concurrency, and docs/design.md, "Redis script",
requires one round trip per request. A Lua script runs atomically inside Redis
and reads every key, decides, and writes in one call. This file is the
request driver; each algorithm's arithmetic and state encoding is its part
under lua/algorithms/. It implements exactly the reference model
`src/storage/algorithm/mod.rs` (`apply_request`) with each algorithm's model
(`src/storage/algorithm/<name>.rs`); the Rust tests compare the two on
random inputs.

Assembly: src/storage/redis/script.rs builds the text at build time as
`local function PART(a)`, then per algorithm
`if a == id then <lua/algorithms/<name>.lua> end`, then `end`, a table
`ALGORITHMS` whose entry `id` is made by `MAKE(id)` (which calls
`PART(id)`) the first time it is used (write `(ALGORITHMS[a] or MAKE(a))`),
then this file as the body of `local function REQUEST(KEYS, ARGV)`. The
script ends with `return REQUEST(KEYS, ARGV)`: all of it runs on every
call, so a call pays for the algorithms it uses only. The Redis Functions
library registers `REQUEST` as its function instead: `ALGORITHMS` lives as
long as the library, and an algorithm's functions are made once. So one
call serves any mix of algorithms, and this file names none. Each algorithm part returns an array of seven functions, in this order,
over its limit's three parameters p1, p2, p3 and its extra parameter x (see
ARGV[3]), and over a *level*: the working value of one key during a request
(a number, or a table the part makes anew on every change), opaque here:
  read(s, p1, p2, p3, now) -> level, stale
      the level at `now` of a key whose stored string is s (false:
      missing; a value of another algorithm's format reads as missing);
      stale: stored with a time after now (rewritten, see below).
  rebase(level, p1, p2, p3, q1, q2, q3) -> level
      a level reached under the limit q1, q2, q3 of the same algorithm,
      under this one (two charges on one key may carry different limits).
      A level of another algorithm is never rebased: the driver reads the
      key as missing under the new one instead.
  consume(level, cost, p1, p2, p3, x) -> level, enough, changed, stands
      enough: the key had what the charge needs; changed: the level must be
      written if the request stands; stands: the charge is taken even when
      the request is denied (a bucket's debt charge; the hits a fixed
      window counts when they do not fit).
  refund(level, cost, p1, p2, p3, x, now) -> level, changed
  report(level, p1, p2, p3, now) -> left[, previous]
      what the key has left in micro-units (the reply's value); a window
      also returns its previous window's count in micro-units, and the
      reply then carries now with it.
  encode(level, now, p1, p2, p3) -> value, ttl_ms
      the string to store and its expiry in ms (at least 1); value nil:
      the key is the same as missing and is deleted.
  kept(level, p1, p2, p3) -> boolean
      whether encode stores a value for level (false: it deletes the key).
      A level written by one request of a batch is read by the next one
      without being encoded: as missing when not kept, else through rebase
      under the reader's limit, which must equal read, at the same now, of
      the string encode stored (a level stored at now has not refilled).
      Under the limit it was written with, a kept level reads back as
      itself: rebase of a kept level under its own limit returns it. (A
      batch's runs of identical requests rely on it: each request starts
      from the level the one before it left, or from read of a missing key
      when that level is not kept.)
A part may return a ninth function (the token bucket does; its eighth is
settle, for reservations), the driver's short cut for a batch's run of
identical plain consumes (neither a refund nor shadow) on a key not stored
after now:
  run(level, cost, p1, p2, p3, x, times, V, nv) -> level, nv, written
      `times` consumes of `cost` in a row from `level`, each exactly as
      consume, the request admitted when it had enough. For each request
      evaluated it appends its reply's values to V after position nv:
      admitted (0 or 1), enough (the same) and left (report of the level
      after it when admitted, before it when denied; a part with a window
      report has no run). written: the number of requests, from the first,
      that wrote the key (changed, or stood); the one after them, when
      there is one, wrote nothing and is the last evaluated: every later
      request repeats its reply. Returns the level the last one left.
and a tenth (the token bucket's too), the short cut for a run of
identical requests of several charges on distinct keys, all plain
consumes, none on a key stored after now (and for a batch of one-charge
requests each on a key of its own, answered request by request):
  steps(level, cost, p1, p2, p3, x) -> fits, take
      from `level`, consumes of `cost` in a row have enough `fits` times,
      each as consume with enough, changed and not standing, leaving the
      level minus `take` (kept, and reported as itself); the one after
      them lacks and changes nothing. nil when consume is not so simple
      (then the driver evaluates request by request).
All values are integers below 2^53 (Lua numbers are doubles).

Units: amounts are micro-units (1 token = 1,000,000) and times are
microseconds since the Unix epoch, all integers.

KEYS[1..k]  distinct keys of the request, or of every request of the batch
            (one per limit and client value; a key several requests
            charge is there once).
ARGV[1]     explicit now in microseconds, TESTS ONLY; the service always sends
            "" and time comes from redis.call('TIME'), so service replicas with
            skewed clocks can never mint tokens (docs/design.md, "Time").
ARGV[2]     shortest expiry in milliseconds, TESTS ONLY ("" = none): with an
            explicit (paused) now, Redis still expires keys in real time, so
            test runs keep keys alive for longer than their algorithm asks.
ARGV[3]     every charge, in request order (a batch: the requests one after
            the other), packed as one binary string of
            32 bytes per charge, big-endian unsigned: algorithm (1 byte),
            key index (3), p1 (4), p2 (4), p3 (4), cost (8), flags (8).
            (One packed argument instead of several decimal strings per
            charge: the client builds no strings and the script runs no
            `tonumber` per value.) The values:
              algorithm  index into ALGORITHMS (0 = token bucket)
              key index  1-based index into KEYS
              p1..p3     the limit, as the algorithm defines them (the token
                         bucket: R, U, C; lua/algorithms/token_bucket.lua)
              cost       tokens, clamped by the caller so that no outcome
                         changes and every amount stays below 2^53; 0 =
                         check only
              flags      bit 0: refund (is_negative_hits), bit 1: shadow mode,
                         flags / 4 (floor): the algorithm's extra parameter x
                         (below 2^40; the token bucket's max_debt D, a
                         window's target of a refund).

ARGV[4]     absent or empty for one request. A batch: per run of
            identical requests (consecutive requests with the same charges,
            byte for byte, and no reservation; a run may be of one
            request), in order, its number of charges per request and its
            number of requests, as big-endian u32s (8 bytes per run).
            ARGV[3] holds a run's charges once; each request of the run is
            evaluated, and answered, on its own.
ARGV[5]     absent when no charge is a reservation's. Else the
            reservation records (docs/design.md, "Reservations"), 32 bytes
            each, big-endian: charge number (4; 1-based over ARGV[3]), op
            (1; 1 = reserve, 2 = settle, 3 = unreserve: a refund that also
            takes its cost off the open reservation), book key index (3; 1-based into
            KEYS: the hash of the bucket's open reservations, in the
            bucket's hash slot), id (16 bytes), ttl in seconds (4),
            max_open (4). A reserve is a consume under D = 0 (it never
            stands) that, when its request is admitted, keeps its cost in the
            book under the id for ttl; past max_open other open
            reservations it does not have enough. A settle always has enough
            and stands: it removes the id from the book and charges the
            excess of its cost over the estimate held (or the whole cost
            when none is open) or gives the rest back (the token bucket's
            eighth function, settle). Book entries: field = id, value =
            tokens (8) and expiry in microseconds (8); an entry past its
            expiry is as missing (it stays until a reserve at the cap, or a
            use of its id, drops it). Field "m": the latest expiry ever
            written, in microseconds (decimal); the hash expires then. A
            book is read per id (HLEN and HGET "m" once, HGET per id used;
            HGETALL only at a reserve that finds it full) and written per
            entry changed (HSET, HDEL), so a call costs the same whatever the
            number of open reservations, but at the cap.

Batch: the requests are evaluated one after the other, each exactly as if
its own call came alone at the same now: it sees what the requests before it
left in every key, it is all-or-nothing on its own, with its own verdicts
and reply. Only the work is shared: one TIME, one MGET of every key, and
each key written at most once, at the end (what the last request that
wrote it left, with that write's expiry). A key that fails to read (a
foreign value: WRONGTYPE) fails only the requests that charge it: their
part of the reply is an error (below) and they write nothing. A run of
identical requests (ARGV[4]) is decoded and read once; each request of it
starts from what the one before it left (see the end of this file).

Reply: one binary string, big-endian. Of a batch: the replies of its
requests one after the other, each as below, or for a request that failed
the byte 2, then its error's length (u16) and the Redis error text
(`WRONGTYPE ...`), or for a run of identical requests answered at once
(`steps`, below) the byte 3, then the number of requests it answers (u32,
at least 1) and how many of them, from the first, are admitted (u32), then
per charge what its key had before the run (i8, micro-units), what each
admitted request takes from it (u8, above 0) and whether it had enough for
the first request denied (1 byte, 0 or 1): request j of the run is
admitted when j <= admitted, every charge then having enough, and each
charge reports what it had before the run less min(j, admitted) takes
(what every request of the run would have answered alone; the caller
expands it, so Redis does no work per request of such a run). Of one request, 1 + 9 n bytes, and 16 more per window
charge:
  admitted   1 byte: 1 if every non-shadow consume charge had enough
             (then all were charged), else 0 (then only the charges that
             stand were written).
  then per charge i, in request order:
  flags_i    1 byte: bit 0: charge i had enough (always for a refund);
             bit 1: a window report follows left_i; bits 2..4: what a
             reservation charge did (reservation.rs ReservationOutcome
             code); bit 5: expired_i follows.
  left_i     8 bytes, signed: what charge i's key has left, in micro-units
             (report), after the request (admitted: under the limit of the
             key's last charge) or before it (not admitted: under charge
             i's limit); negative while in debt or over a window's limit.
  at_i       (window report) 8 bytes: now, in microseconds.
  prev_i     (window report) 8 bytes: the previous window's count, in
             micro-units.
  expired_i  (bit 5) 4 bytes: expired reservations charge i dropped from
             its book.
(One packed string instead of an array of 2n + 1 integers: the client parses
it in a few instructions, where an array of integers costs a parser step per
element.)
Durations and remaining counts are computed by the caller from these.

Reads: one MGET of every key; the keys it finds missing are checked with
one EXISTS, and read again with GET only when some of them exist (a value
of another type, which GET refuses with WRONGTYPE). The books of
reservations (ARGV[5]) are in KEYS too; MGET reads them as missing and they
are left out of that check; each is read with HGETALL when first used.

Writes (per request, then each key once at the end of the call): a key
whose level changed is written (SET with PX, its algorithm's encode; DEL
when it is the same as missing) when the request is admitted;
when it is denied, only the keys of the charges that stand, with only those
charges applied. A check (cost 0), a refund on a full bucket and a denied
request write nothing and refresh no TTL. A key stored with a time after now
(Redis's clock stepped back) that nothing else writes is written as read,
stamped now, admitted or not: otherwise every later call would read "no
time elapsed" until the clock caught up (docs/design.md, "Time").
]]

local MICRO = 1000000
-- Longest expiry written, in ms (about 31,700 years): keeps now + PX inside
-- Redis's 64-bit millisecond clock; such keys are never reset in practice.
local MAX_TTL_MS = 1000000000000000
-- ARGV[2]: shortest expiry for test runs (0 = none).
local min_ttl = tonumber(ARGV[2]) or 0
-- Library functions as locals: a local is one VM register, a global a table
-- lookup per use.
local rcall, pcall_redis = redis.call, redis.pcall
local spack, sunpack = struct.pack, struct.unpack
local fmod = math.fmod
local schar = string.char
-- Positions of an algorithm's functions in its array (see the header).
local READ, REBASE, CONSUME, REFUND, REPORT, ENCODE, KEPT, SETTLE, RUN, STEPS = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = rcall('TIME')
  now = tonumber(t[1]) * MICRO + tonumber(t[2])
end

-- ARGV[4]: the request sizes of a batch (absent: one request).
local sizes = ARGV[4]
if sizes == '' then
  sizes = nil
end
local batch = sizes ~= nil

-- ARGV[5]: the reservation records by charge number (nil: none).
local RES
if ARGV[5] ~= nil and ARGV[5] ~= '' then
  RES = {}
  local recs = ARGV[5]
  for pos = 1, #recs, 32 do
    local cno, op, bk, id, ttl, maxopen = sunpack('>I4I1I3c16I4I4', recs, pos)
    RES[cno] = { op, bk, id, ttl, maxopen }
  end
end

-- Whether a request of the batch has several charges: the paths for such
-- requests are made only then (as `general`, for a call of one request
-- or with reservations).
local multi = false
if batch then
  for pos = 1, #sizes, 8 do
    if sunpack('>I4', sizes, pos) > 1 then
      multi = true
      break
    end
  end
end
local need_general = not batch or RES ~= nil or multi

-- Every key in one MGET (in slices, to stay inside Lua's stack for a
-- call with very many keys). MGET reads a key of another type as
-- missing, so the keys it reports missing are checked with one EXISTS;
-- only when some of them exist is each read again with GET, which fails
-- with WRONGTYPE on a foreign key instead of letting it be overwritten. A
-- hot key exists, so the check is paid by calls with new keys only.
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

-- The books (hashes, which MGET reads as missing) are not checked.
local isbook = false
if RES then
  isbook = {}
  for _, r in pairs(RES) do
    isbook[r[2]] = true
  end
end
local absent, na = nil, 0
for i = 1, nk do
  if not vals[i] and not (isbook and isbook[i]) then
    if na == 0 then
      absent = {}
    end
    na = na + 1
    absent[na] = KEYS[i]
  end
end
local foreign = false
for i = 1, na, 512 do
  local j = i + 511
  if j > na then
    j = na
  end
  if rcall('EXISTS', unpack(absent, i, j)) > 0 then
    foreign = true
  end
end

-- Writes key k's level as its algorithm encodes it at now under the limit
-- p1, p2, p3, with its expiry within the bounds (SET with PX; DEL when it
-- is the same as missing).
local function store(k, alg, level, p1, p2, p3)
  local value, ttl = alg[ENCODE](level, now, p1, p2, p3)
  if value == nil then
    rcall('DEL', KEYS[k])
  else
    if ttl < min_ttl then
      ttl = min_ttl
    end
    if ttl > MAX_TTL_MS then
      ttl = MAX_TTL_MS
    end
    rcall('SET', KEYS[k], value, 'PX', string.format('%d', ttl))
  end
end

-- A call of one request with one charge, every call at low load: the
-- one-charge path of a batch (at the end), with its write (making the
-- functions below costs more than this path's own work).
if not batch and #ARGV[3] == 32 and RES == nil then
  local a, k, p1, p2, p3, cost, flags = sunpack('>I1I3I4I4I4I8I8', ARGV[3], 1)
  local alg = (ALGORITHMS[a] or MAKE(a))
  local s = vals[k]
  if not s and foreign then
    -- Missing, or another type: GET tells them apart (WRONGTYPE).
    s = rcall('GET', KEYS[k])
  end
  local low = flags % 4
  local w, stale = alg[READ](s, p1, p2, p3, now)
  local after, ok, changed, stands
  if low % 2 == 1 then
    after, changed = alg[REFUND](w, cost, p1, p2, p3, (flags - low) / 4, now)
    ok = true
  else
    after, ok, changed, stands = alg[CONSUME](w, cost, p1, p2, p3, (flags - low) / 4)
  end
  local admitted = ok or low >= 2
  local level
  if (admitted and changed) or (not admitted and stands) then
    level = after
  elseif stale then
    level = w
  end
  if level ~= nil then
    store(k, alg, level, p1, p2, p3)
  end
  local left, prev
  if admitted then
    left, prev = alg[REPORT](after, p1, p2, p3, now)
  else
    left, prev = alg[REPORT](w, p1, p2, p3, now)
  end
  local enough = (admitted and ok) and 1 or 0
  if prev == nil then
    return spack('>BBi8', admitted and 1 or 0, enough, left)
  end
  return spack('>BBi8I8I8', admitted and 1 or 0, enough + 2, left, now, prev)
end

-- The summary reply of a run of `times` requests of n charges, the first
-- `admit` of them admitted (see "Reply" in the header): per charge c, what
-- its key had before the run W[c], what each admitted request takes T[c],
-- and how many would fit F[c] (it had enough for the first one denied when
-- F[c] > admit). V: a table for the values.
local function run_summary(times, admit, n, W, T, F, V)
  V[1], V[2], V[3] = 3, times, admit
  local nv = 3
  for c = 1, n do
    local enough = 0
    if F[c] > admit then
      enough = 1
    end
    V[nv + 1], V[nv + 2], V[nv + 3] = W[c], T[c], enough
    nv = nv + 3
  end
  local fmt = '>BI4I4i8I8B'
  if n > 1 then
    fmt = '>BI4I4' .. string.rep('i8I8B', n)
  end
  return spack(fmt, unpack(V, 1, nv))
end

-- A batch that is one run of identical requests (the hot bucket under
-- load: every request of the call carries the same descriptors) of plain
-- consumes on distinct keys, none stored after now, whose algorithms have
-- `steps` (the token bucket without a debt bound): answered at once, as
-- the batch's `several_run` and one-charge paths do (see there), before
-- the functions and tables the other paths need are made. Any other batch
-- goes on below; this path has only read.
if batch and RES == nil and #sizes == 8 then
  local n, times = sunpack('>I4I4', sizes, 1)
  if n <= 16 and n == nk then
    local packed = ARGV[3]
    local ok, pos, admit = true, 1, times
    -- Per charge: algorithm, level, take, fits. (n == nk: the keys are
    -- distinct.)
    -- (Room for two charges: a table that grows is rehashed.)
    local A, W, T, F = { nil, nil }, { nil, nil }, { nil, nil }, { nil, nil }
    for c = 1, n do
      local a, k, p1, p2, p3, cost, flags
      a, k, p1, p2, p3, cost, flags, pos = sunpack('>I1I3I4I4I4I8I8', packed, pos)
      local alg = (ALGORITHMS[a] or MAKE(a))
      local stepsf = alg[STEPS]
      local s = vals[k]
      if flags % 4 ~= 0 or stepsf == nil or (not s and foreign) then
        ok = false
        break
      end
      local w, stale = alg[READ](s, p1, p2, p3, now)
      local fits, take
      if not stale then
        fits, take = stepsf(w, cost, p1, p2, p3, flags / 4)
      end
      if fits == nil then
        ok = false
        break
      end
      if fits < admit then
        admit = fits
      end
      A[c], W[c], T[c], F[c] = alg, w, take, fits
    end
    if ok then
      if admit > 0 then
        pos = 1
        for c = 1, n do
          local _, k, p1, p2, p3 = sunpack('>I1I3I4I4I4', packed, pos)
          store(k, A[c], W[c] - admit * T[c], p1, p2, p3)
          pos = pos + 32
        end
      end
      -- (Room for two charges' values: a table that grows is rehashed.)
      return run_summary(times, admit, n, W, T, F, { nil, nil, nil, nil, nil, nil, nil, nil, nil })
    end
  end
end

-- A batch of requests of one charge each, every one on a key of its own
-- (per-user limits: nothing repeats, so nothing forms a run), all plain
-- consumes on algorithms with `steps` (the token bucket without a debt
-- bound): each request is answered as its own call would be, from what
-- its key holds (a key stored after now is written as read when its
-- request is denied, as on the one-charge path), without the per-key
-- records the paths below keep for keys charged twice. Any other batch
-- goes on below; this path has only read until it knows it answers the
-- whole batch. (Its decoding repeats the single-run path's above: one
-- function for both, made on every call, cost each call about 3 % more.)
if batch and RES == nil and not multi and nk >= 2 and #sizes == 8 * nk
  and sizes == string.rep('\0\0\0\1\0\0\0\1', nk) then
  local packed = ARGV[3]
  local ok, pos = true, 1
  -- Per request c: its reply's values V[3c - 2 .. 3c], and the level its
  -- key is written with, LV[c] (false: not written).
  local V, LV = { nil, nil, nil, nil, nil, nil }, { nil, nil }
  for c = 1, nk do
    local a, k, p1, p2, p3, cost, flags
    a, k, p1, p2, p3, cost, flags, pos = sunpack('>I1I3I4I4I4I8I8', packed, pos)
    local alg = (ALGORITHMS[a] or MAKE(a))
    local stepsf = alg[STEPS]
    local s = vals[k]
    if flags % 4 ~= 0 or stepsf == nil or (not s and foreign) then
      ok = false
      break
    end
    local w, stale = alg[READ](s, p1, p2, p3, now)
    local fits, take = stepsf(w, cost, p1, p2, p3, flags / 4)
    if fits == nil then
      ok = false
      break
    end
    if fits > 0 then
      V[3 * c - 2], V[3 * c - 1], V[3 * c] = 1, 1, w - take
      LV[c] = w - take
    else
      V[3 * c - 2], V[3 * c - 1], V[3 * c] = 0, 0, w
      LV[c] = stale and w
    end
  end
  if ok then
    pos = 1
    for c = 1, nk do
      local level = LV[c]
      if level then
        local a, k, p1, p2, p3 = sunpack('>I1I3I4I4I4', packed, pos)
        store(k, ALGORITHMS[a], level, p1, p2, p3)
      end
      pos = pos + 32
    end
    return spack('>' .. string.rep('BBi8', nk), unpack(V, 1, 3 * nk))
  end
end

-- Per key k (index into KEYS): its stored string as read (CUR[k], false:
-- missing; nil: not read yet; true: written by a request of this call);
-- for a written key REC[k] = { level, whether encode keeps it, the
-- algorithm and the limit (p1, p2, p3) it was written under }, encoded
-- once at the end; the written keys in ORDER. (One table per written key
-- rather than one per field: a table costs on every call that makes it.)
local CUR, REC, ORDER = { nil, nil, nil, nil, nil, nil, nil, nil }, { nil, nil, nil, nil, nil, nil, nil, nil }, { nil, nil, nil, nil, nil, nil, nil, nil }
local nw = 0

-- The stored string of key k (false: missing; true: written in this call),
-- or nil and the error of reading it. In a batch the error fails only the
-- requests that read k.
local function stored(k)
  local s = CUR[k]
  if s ~= nil then
    return s
  end
  s = vals[k]
  if not s and foreign then
    -- Missing, or another type: GET tells them apart (WRONGTYPE).
    if batch then
      s = pcall_redis('GET', KEYS[k])
      if type(s) == 'table' then
        return nil, s.err
      end
    else
      s = rcall('GET', KEYS[k])
    end
  end
  CUR[k] = s
  return s
end

-- The level at now of key k, from `s` (what `stored` gave), under the given
-- limit, and whether it was stored after now.
local function readk(alg, k, s, p1, p2, p3)
  if s == true then
    -- (A key written under another algorithm reads as missing.)
    local r = REC[k]
    if r[2] and r[3] == alg then
      return alg[REBASE](r[1], p1, p2, p3, r[4], r[5], r[6]), false
    end
    return alg[READ](false, p1, p2, p3, now)
  end
  return alg[READ](s, p1, p2, p3, now)
end

-- Writes `level` for key k, stamped now, under the given limit: what the
-- next request reads, and what is stored at the end. Returns whether
-- encode keeps it.
local function put(k, alg, p1, p2, p3, level)
  local kept = alg[KEPT](level, p1, p2, p3)
  local r = REC[k]
  if r == nil then
    CUR[k] = true
    nw = nw + 1
    ORDER[nw] = k
    REC[k] = { level, kept, alg, p1, p2, p3 }
  else
    r[1], r[2], r[3], r[4], r[5], r[6] = level, kept, alg, p1, p2, p3
  end
  return kept
end

-- Books of open reservations, per book key index bk: BOOK[bk] as the
-- requests of this call so far left it: { map = id -> { tokens, expiry }
-- or false (none), n = entries, bk, orig = id -> what Redis held (read per
-- id with HGET as ids are used, all at once with HGETALL only at a
-- reserve that finds the book full), m = the latest expiry ever written
-- (the field "m") }; BORDER lists the books written, in order.
-- Per request: the working copy WB[bk] and whether it changed (WBD), the
-- copy with only the settlements (KB, KBD), the books touched (RB); per
-- charge its outcome (OUTC) and expired entries dropped (EXPC). Made
-- only when the call carries reservation records: a closure or a table
-- costs on every call that makes it.
local BOOK, BOOKW, BORDER, nb, WB, WBD, KB, KBD, RB, OUTC, EXPC
local nrb = 0
local MAX_HELD = 8589934592
local load_book, fetched, get, load_all, copy_book, wbook, kbook, make_room, record, settle_book, flush_books
if RES then
  BOOK, BOOKW, BORDER, nb = {}, {}, {}, 0
  WB, WBD, KB, KBD, RB, OUTC, EXPC = {}, {}, {}, {}, {}, {}, {}

  load_book = function(bk)
    local b = BOOK[bk]
    if b == nil then
      local n = rcall('HLEN', KEYS[bk])
      local m = rcall('HGET', KEYS[bk], 'm')
      if m then
        n = n - 1
        m = tonumber(m)
      else
        m = 0
      end
      b = { map = {}, n = n, bk = bk, orig = {}, m = m }
      BOOK[bk] = b
    end
    return b
  end

  -- What Redis held for id, decoded (false: none), noted in the book `b`,
  -- in the book of the call and as read.
  fetched = function(b, id, v)
    local h = false
    if v then
      local t, e = sunpack('>I8I8', v)
      h = { t, e }
    end
    b.map[id] = h
    local base = BOOK[b.bk]
    if base.map[id] == nil then
      base.map[id] = h
    end
    base.orig[id] = h
    return h
  end

  -- The entry of id in book b (false: none).
  get = function(b, id)
    local h = b.map[id]
    if h == nil then
      h = fetched(b, id, rcall('HGET', KEYS[b.bk], id))
    end
    return h
  end

  -- Every entry of book b (a reserve at the cap looks at them all).
  load_all = function(b)
    local flat = rcall('HGETALL', KEYS[b.bk])
    for i = 1, #flat, 2 do
      local id = flat[i]
      if id ~= 'm' and b.map[id] == nil then
        fetched(b, id, flat[i + 1])
      end
    end
  end

  copy_book = function(b)
    local m = {}
    for id, h in pairs(b.map) do
      m[id] = h
    end
    return { map = m, n = b.n, bk = b.bk, orig = b.orig, m = b.m }
  end

  wbook = function(bk)
    local b = WB[bk]
    if b == nil then
      b = copy_book(load_book(bk))
      WB[bk], WBD[bk] = b, false
      nrb = nrb + 1
      RB[nrb] = bk
    end
    return b
  end

  kbook = function(bk)
    local b = KB[bk]
    if b == nil then
      b = copy_book(load_book(bk))
      KB[bk], KBD[bk] = b, false
    end
    return b
  end

  -- Whether the book is full of other open reservations for a reserve of
  -- id, and the expired entries dropped to find out (reservation.rs
  -- make_room).
  make_room = function(b, id, maxopen)
    local expired = 0
    local h = get(b, id)
    if h then
      if h[2] > now then
        return false, 0
      end
      b.map[id] = false
      b.n = b.n - 1
      expired = 1
    end
    if b.n >= maxopen then
      load_all(b)
      for i, x in pairs(b.map) do
        if x and x[2] <= now then
          b.map[i] = false
          b.n = b.n - 1
          expired = expired + 1
        end
      end
    end
    return b.n >= maxopen, expired
  end

  -- Records an admitted reserve (reservation.rs record): 1 opened, 2 added.
  record = function(b, id, cost, ttl)
    local e = now + ttl * MICRO
    local h = get(b, id)
    if h then
      local t = h[1] + cost
      if t > MAX_HELD then
        t = MAX_HELD
      end
      b.map[id] = { t, e }
      return 2
    end
    if cost > MAX_HELD then
      cost = MAX_HELD
    end
    b.map[id] = { cost, e }
    b.n = b.n + 1
    return 1
  end

  -- A settlement on level w (reservation.rs settle): the level after it,
  -- the outcome (4 settled, 5 none open) and the expired entries dropped.
  settle_book = function(alg, w, b, id, cost, p1, p2, p3, x)
    local h = get(b, id)
    if h then
      b.map[id] = false
      b.n = b.n - 1
    end
    if h and h[2] > now then
      return alg[SETTLE](w, h[1], cost, p1, p2, p3, x), 4, 0
    end
    return alg[SETTLE](w, false, cost, p1, p2, p3, x), 5, h and 1 or 0
  end
end

-- The working tables of a request with several charges, per key k (index
-- into KEYS): the stored string RAW[k] (false: missing), the working level
-- W[k] and whether it changed (DIRTY[k]), the algorithm and limit of its
-- last charge (LA, L1, L2, L3), the level after only the charges that
-- stand (DW[k], written when the request is denied) and where in ARGV[3]
-- the last of them is (DP[k]), and for a key stored after now the level
-- read before any charge (STALE[k]); the request's keys in RK; per charge
-- c its key KEY[c] and whether it had enough (ENOUGH[c]); the reply's
-- values (REPLY) and per charge its format (PIECES); reply formats of
-- requests without window charges by number of charges (FORMATS). Made by the first such request of the call (WT holds
-- them: a function with many upvalues costs more to make on every call),
-- emptied after each request, so each request starts from nothing, as
-- alone.
local WT
local packed = ARGV[3]

-- `push` and `general` are made only by a call that runs a request of
-- several charges or with reservations: a function with many upvalues
-- costs on every call that makes it.
local push, general
if need_general then
  -- Charge c's part of a reply after the first nv values of `reply`: its
  -- flags (enough: 0 or 1), what is left and, when `prev` is given, a
  -- window report (now and prev); its format in pieces[c]. Returns the new
  -- number of values and whether a window report was added.
  push = function(reply, nv, pieces, c, enough, left, prev)
    if prev == nil then
      reply[nv + 1], reply[nv + 2] = enough, left
      pieces[c] = 'Bi8'
      return nv + 2, false
    end
    reply[nv + 1], reply[nv + 2], reply[nv + 3], reply[nv + 4] = enough + 2, left, now, prev
    pieces[c] = 'Bi8I8I8'
    return nv + 4, true
  end

  -- One request of n charges starting at byte `first` of ARGV[3]: its reply
  -- (see the header), or nil and the error of reading one of its keys. (A
  -- batch runs a request without reservations of one charge, or of several
  -- on distinct keys, on the shorter paths below.)
  general = function(first, n)
    local t = WT
    if t == nil then
      t = { {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {} }
      WT = t
    end
    local RAW, W, DIRTY, LA, L1, L2, L3, DW, STALE = t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9]
    local RK, KEY, ENOUGH, REPLY, FORMATS, DP, PIECES = t[10], t[11], t[12], t[13], t[14], t[15], t[16]
    local admitted = true
    local nr = 0
    local failed
    local pos = first
    for c = 1, n do
      local a, k, p1, p2, p3, cost, flags
      local cpos = pos
      a, k, p1, p2, p3, cost, flags, pos = sunpack('>I1I3I4I4I4I8I8', packed, pos)
      local alg = (ALGORITHMS[a] or MAKE(a))
      KEY[c] = k
      -- Exact: flags < 2^35 and the divisors are powers of two.
      local low = flags % 4
      local refund = low % 2 == 1
      local shadow = low >= 2
      local w = W[k]
      if w == nil then
        local s, err = stored(k)
        if s == nil then
          failed = err
          break
        end
        nr = nr + 1
        RK[nr] = k
        RAW[k] = s
        local stale
        w, stale = readk(alg, k, s, p1, p2, p3)
        if stale then
          STALE[k] = w
        end
        DIRTY[k] = false
      elseif LA[k] ~= alg then
        -- Another algorithm on the key: it is as missing under this one.
        w = alg[READ](false, p1, p2, p3, now)
      else
        w = alg[REBASE](w, p1, p2, p3, L1[k], L2[k], L3[k])
      end
      LA[k], L1[k], L2[k], L3[k] = alg, p1, p2, p3
      local x = (flags - low) / 4
      local rec = RES and RES[(cpos - 1) / 32 + 1]
      if rec and rec[1] == 1 then
        -- A reserve: a consume under D = 0, and room in the book.
        local bk = rec[2]
        local b = wbook(bk)
        local full, expired = make_room(b, rec[3], rec[5])
        if expired > 0 then
          WBD[bk] = true
        end
        local after, ok, changed = alg[CONSUME](w, cost, p1, p2, p3, 0)
        local outcome = 0
        if full then
          outcome = 3
        end
        if ok and not full then
          if changed then
            w = after
            DIRTY[k] = true
          end
          outcome = record(b, rec[3], cost, rec[4])
          WBD[bk] = true
          ENOUGH[c] = 1
        else
          ENOUGH[c] = 0
          if not shadow then
            admitted = false
          end
        end
        OUTC[c], EXPC[c] = outcome, expired
      elseif rec and rec[1] == 3 then
        -- An unreserve (reservation.rs unreserve): a refund that also takes
        -- its cost off the open reservation.
        local bk = rec[2]
        local b = wbook(bk)
        local h = get(b, rec[3])
        local c2 = cost
        if c2 > MAX_HELD then
          c2 = MAX_HELD
        end
        if h and h[2] > now then
          if h[1] <= c2 then
            b.map[rec[3]] = false
            b.n = b.n - 1
          else
            b.map[rec[3]] = { h[1] - c2, h[2] }
          end
          WBD[bk] = true
        end
        local after, changed = alg[REFUND](w, c2, p1, p2, p3, x, now)
        if changed then
          w = after
          DIRTY[k] = true
        end
        ENOUGH[c] = 1
        OUTC[c], EXPC[c] = 0, 0
      elseif rec then
        -- A settlement: always enough, and it stands.
        local bk = rec[2]
        local after, outcome, expired = settle_book(alg, w, wbook(bk), rec[3], cost, p1, p2, p3, x)
        if after ~= w then
          w = after
          DIRTY[k] = true
        end
        if outcome == 4 or expired > 0 then
          WBD[bk] = true
        end
        local d = DW[k]
        if d == nil then
          d = readk(alg, k, RAW[k], p1, p2, p3)
        else
          local _, _, q1, q2, q3 = sunpack('>I1I3I4I4I4', packed, DP[k])
          d = alg[REBASE](d, p1, p2, p3, q1, q2, q3)
        end
        local kd, kout, kexp = settle_book(alg, d, kbook(bk), rec[3], cost, p1, p2, p3, x)
        if kout == 4 or kexp > 0 then
          KBD[bk] = true
        end
        DW[k] = kd
        DP[k] = cpos
        ENOUGH[c] = 1
        OUTC[c], EXPC[c] = outcome, expired
      elseif refund then
        local changed
        w, changed = alg[REFUND](w, cost, p1, p2, p3, x, now)
        if changed then
          DIRTY[k] = true
        end
        ENOUGH[c] = 1
      else
        local ok, changed, stands
        w, ok, changed, stands = alg[CONSUME](w, cost, p1, p2, p3, x)
        if ok then
          ENOUGH[c] = 1
        else
          ENOUGH[c] = 0
          if not shadow then
            admitted = false
          end
        end
        if changed then
          DIRTY[k] = true
        end
        if stands then
          local d = DW[k]
          if d == nil then
            d = readk(alg, k, RAW[k], p1, p2, p3)
          else
            local _, _, q1, q2, q3 = sunpack('>I1I3I4I4I4', packed, DP[k])
            d = alg[REBASE](d, p1, p2, p3, q1, q2, q3)
          end
          DW[k] = alg[CONSUME](d, cost, p1, p2, p3, x)
          DP[k] = cpos
        end
      end
      W[k] = w
    end

    local out
    if failed == nil then
      -- (`RK` lists every key of the request.)
      local reply = REPLY
      -- Values in `reply`, and whether a window report is among them.
      local nv, wide, w = 1, false, false
      if admitted then
        reply[1] = 1
        for i = 1, nr do
          local k = RK[i]
          if DIRTY[k] then
            put(k, LA[k], L1[k], L2[k], L3[k], W[k])
          elseif STALE[k] then
            put(k, LA[k], L1[k], L2[k], L3[k], STALE[k])
          end
        end
        for c = 1, n do
          local k = KEY[c]
          local at = nv + 1
          nv, w = push(reply, nv, PIECES, c, ENOUGH[c], LA[k][REPORT](W[k], L1[k], L2[k], L3[k], now))
          wide = wide or w
          local o = RES and OUTC[c]
          if o then
            reply[at] = reply[at] + 4 * o
            if EXPC[c] > 0 then
              reply[at] = reply[at] + 32
              nv = nv + 1
              reply[nv] = EXPC[c]
              PIECES[c] = PIECES[c] .. 'I4'
              wide = true
            end
          end
        end
        for i = 1, nrb do
          local bk = RB[i]
          if WBD[bk] then
            BOOK[bk] = WB[bk]
            if not BOOKW[bk] then
              BOOKW[bk] = true
              nb = nb + 1
              BORDER[nb] = bk
            end
          end
        end
      else
        reply[1] = 0
        -- What each key had before the request, under each charge's own limit
        -- (read before this request's writes).
        pos = first
        for c = 1, n do
          local a, k, p1, p2, p3
          a, k, p1, p2, p3 = sunpack('>I1I3I4I4I4', packed, pos)
          pos = pos + 32
          local alg = (ALGORITHMS[a] or MAKE(a))
          local at = nv + 1
          nv, w = push(reply, nv, PIECES, c, ENOUGH[c], alg[REPORT]((readk(alg, k, RAW[k], p1, p2, p3)), p1, p2, p3, now))
          wide = wide or w
          local o = RES and OUTC[c]
          if o then
            local rec = RES[(pos - 33) / 32 + 1]
            local e = EXPC[c]
            -- A denied request keeps no reserve: only a refusal at the cap
            -- is reported, and expired entries count where written.
            if rec[1] == 1 then
              e = 0
              if o ~= 3 then
                o = 0
              end
            end
            reply[at] = reply[at] + 4 * o
            if e > 0 then
              reply[at] = reply[at] + 32
              nv = nv + 1
              reply[nv] = e
              PIECES[c] = PIECES[c] .. 'I4'
              wide = true
            end
          end
        end
        for i = 1, nrb do
          local bk = RB[i]
          if KBD[bk] then
            BOOK[bk] = KB[bk]
            if not BOOKW[bk] then
              BOOKW[bk] = true
              nb = nb + 1
              BORDER[nb] = bk
            end
          end
        end
        for i = 1, nr do
          local k = RK[i]
          local d = DW[k]
          if d then
            -- The charges that stand, applied under their own limits: the
            -- level is rebased to the limit it is stored under (the key's
            -- last charge), as the next request reads it.
            local a, _, q1, q2, q3 = sunpack('>I1I3I4I4I4', packed, DP[k])
            local alg = LA[k]
            if (ALGORITHMS[a] or MAKE(a)) == alg then
              d = alg[REBASE](d, L1[k], L2[k], L3[k], q1, q2, q3)
            else
              d = alg[READ](false, L1[k], L2[k], L3[k], now)
            end
            put(k, alg, L1[k], L2[k], L3[k], d)
          elseif STALE[k] then
            put(k, LA[k], L1[k], L2[k], L3[k], STALE[k])
          end
        end
      end
      local fmt
      if wide then
        fmt = '>B' .. table.concat(PIECES, '', 1, n)
      else
        fmt = FORMATS[n]
        if fmt == nil then
          fmt = '>B' .. string.rep('Bi8', n)
          FORMATS[n] = fmt
        end
      end
      if nv <= 6000 then
        out = spack(fmt, unpack(reply, 1, nv))
      else
        -- A request of thousands of charges: packed in slices of charges,
        -- within the values `unpack` can push (about 8,000). A piece of k
        -- letters ('Bi8', 'Bi8I8I8', with 'I4') packs (k + 1) / 2 values.
        local slices, ns, v, c = { schar(reply[1]) }, 1, 2, 1
        while c <= n do
          local f, nf, cnt = { '>' }, 1, 0
          while c <= n and cnt < 6000 do
            local piece = PIECES[c]
            nf = nf + 1
            f[nf] = piece
            cnt = cnt + (#piece + 1) / 2
            c = c + 1
          end
          ns = ns + 1
          slices[ns] = spack(table.concat(f), unpack(reply, v, v + cnt - 1))
          v = v + cnt
        end
        out = table.concat(slices)
      end
    end
    -- Empty the working tables for the next request.
    for i = 1, nr do
      local k = RK[i]
      RAW[k], W[k], DIRTY[k], LA[k], L1[k], L2[k], L3[k], DW[k], STALE[k], DP[k] =
        nil, nil, nil, nil, nil, nil, nil, nil, nil, nil
    end
    if RES then
      for i = 1, nrb do
        local bk = RB[i]
        WB[bk], WBD[bk], KB[bk], KBD[bk] = nil, nil, nil, nil
      end
      nrb = 0
      for c = 1, n do
        OUTC[c], EXPC[c] = nil, nil
      end
    end
    if failed ~= nil then
      return nil, failed
    end
    return out
  end
end

-- Stores the books the requests wrote: only the entries that changed
-- (HSET, HDEL), the latest expiry ever written in the field "m", and the
-- hash expires then (an empty book is deleted).
if RES then
  flush_books = function()
    for i = 1, nb do
      local bk = BORDER[i]
      local b = BOOK[bk]
      if b.n <= 0 then
        rcall('DEL', KEYS[bk])
      else
        local set, ns, del, nd, m = {}, 0, {}, 0, b.m
        for id, h in pairs(b.map) do
          local o = b.orig[id]
          if h then
            if not o or o[1] ~= h[1] or o[2] ~= h[2] then
              set[ns + 1] = id
              set[ns + 2] = spack('>I8I8', h[1], h[2])
              ns = ns + 2
              if h[2] > m then
                m = h[2]
              end
            end
          elseif o then
            nd = nd + 1
            del[nd] = id
          end
        end
        for j = 1, nd, 1000 do
          local last = j + 999
          if last > nd then
            last = nd
          end
          rcall('HDEL', KEYS[bk], unpack(del, j, last))
        end
        for j = 1, ns, 1000 do
          local last = j + 999
          if last > ns then
            last = ns
          end
          rcall('HSET', KEYS[bk], unpack(set, j, last))
        end
        if m ~= b.m then
          rcall('HSET', KEYS[bk], 'm', string.format('%d', m))
        end
        local us = m - now
        local ttl = (us - fmod(us, 1000)) / 1000
        if fmod(us, 1000) > 0 then
          ttl = ttl + 1
        end
        if ttl < 1 then
          ttl = 1
        end
        if ttl < min_ttl then
          ttl = min_ttl
        end
        if ttl > MAX_TTL_MS then
          ttl = MAX_TTL_MS
        end
        rcall('PEXPIRE', KEYS[bk], string.format('%d', ttl))
      end
    end
  end
end

-- Stores what the requests left: each key written once, with the expiry
-- of its last write.
local function flush()
  if RES then
    flush_books()
  end
  for i = 1, nw do
    local k = ORDER[i]
    local r = REC[k]
    store(k, r[3], r[1], r[4], r[5], r[6])
  end
end

if not batch then
  local reply = general(1, #packed / 32)
  flush()
  return reply
end

-- A batch: its runs of identical requests (ARGV[4]) in order. A run of
-- requests of one charge and no reservation (the usual request; a hot
-- bucket under load gives long runs) runs inline below: the one-charge
-- case of `general` without its tables, decoded and read once. Each
-- request of the run starts from the level the one before it left on the
-- key (what `readk` would give), and when a request writes nothing, every
-- later one of the run, at the same now, has the same outcome and reply,
-- so it is not computed again. The replies of a run are packed in one
-- `struct.pack`.
local ssub, srep = string.sub, string.rep
-- A request of several charges on distinct keys, without reservations (a
-- request with several descriptors): what `general` does, without its
-- per-key tables, since each key has one charge: the level after only the
-- charges that stand is the charge's own result, and what a key had before
-- the request is the level read. A run of identical such requests (the
-- same bytes of ARGV[3]) is decoded and read once, as for one charge below:
-- each repeat starts from what the request before it left on each key
-- (SW), and repeats a reply when that request wrote nothing (msame). Per
-- charge c: algorithm, key, limit, cost, flags % 4 and extra parameter (SA,
-- SK, S1, S2, S3, SC, SL, SX), the level read (SW), stored after now (SS),
-- the level after the charge, enough,
-- changed, stands (SF, SO, SG, SD); the reply's values and formats (SV,
-- SP); reply formats by number of charges (SFORMATS). Made by the first
-- such request of the call (ST), reused after.
local ST, MARK, SFORMATS
local mc, msame

-- Its reply, or nil and the error of reading one of its keys; false when
-- two of its charges share a key (then `general` runs it).
local several
if batch and multi and RES == nil then
  several = function(first, n)
    local t = ST
    if t == nil then
      t = { {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {} }
      ST, MARK, SFORMATS = t, {}, {}
    end
    local SA, SK, S1, S2, S3, SC, SL, SX, SW = t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9]
    local SS, SF, SO, SG, SD, SV, SP = t[10], t[12], t[13], t[14], t[15], t[16], t[17]
    local bytes = ssub(packed, first, first + 32 * n - 1)
    if bytes == mc then
      if msame then
        return msame
      end
    else
      mc = nil
      local pos = first
      for c = 1, n do
        local a, k, p1, p2, p3, cost, flags
        a, k, p1, p2, p3, cost, flags, pos = sunpack('>I1I3I4I4I4I8I8', packed, pos)
        if MARK[k] == first then
          return false
        end
        MARK[k] = first
        local low = flags % 4
        -- Exact: flags < 2^35 and the divisors are powers of two.
        SA[c], SK[c], S1[c], S2[c], S3[c], SC[c], SL[c], SX[c] = (ALGORITHMS[a] or MAKE(a)), k, p1, p2, p3, cost, low, (flags - low) / 4
      end
      for c = 1, n do
        local k = SK[c]
        local s, err = stored(k)
        if s == nil then
          return nil, err
        end
        SW[c], SS[c] = readk(SA[c], k, s, S1[c], S2[c], S3[c])
      end
    end
    local admitted = true
    for c = 1, n do
      local alg, low = SA[c], SL[c]
      if low % 2 == 1 then
        SF[c], SG[c] = alg[REFUND](SW[c], SC[c], S1[c], S2[c], S3[c], SX[c], now)
        SO[c], SD[c] = true, false
      else
        local ok
        SF[c], ok, SG[c], SD[c] = alg[CONSUME](SW[c], SC[c], S1[c], S2[c], S3[c], SX[c])
        SO[c] = ok
        if not ok and low < 2 then
          admitted = false
        end
      end
    end
    -- The reply: what each key has left after the request (admitted) or
    -- had before it (denied), under the charge's limit.
    local nv, wide = 1, false
    SV[1] = admitted and 1 or 0
    for c = 1, n do
      local left, prev
      if admitted then
        left, prev = SA[c][REPORT](SF[c], S1[c], S2[c], S3[c], now)
      else
        left, prev = SA[c][REPORT](SW[c], S1[c], S2[c], S3[c], now)
      end
      local enough = SO[c] and 1 or 0
      if prev == nil then
        SV[nv + 1], SV[nv + 2] = enough, left
        SP[c] = 'Bi8'
        nv = nv + 2
      else
        SV[nv + 1], SV[nv + 2], SV[nv + 3], SV[nv + 4] = enough + 2, left, now, prev
        SP[c] = 'Bi8I8I8'
        nv = nv + 4
        wide = true
      end
    end
    local fmt
    if wide then
      fmt = '>B' .. table.concat(SP, '', 1, n)
    else
      fmt = SFORMATS[n]
      if fmt == nil then
        fmt = '>B' .. string.rep('Bi8', n)
        SFORMATS[n] = fmt
      end
    end
    local out = spack(fmt, unpack(SV, 1, nv))
    -- The writes (`put`), and what the next request on each key reads
    -- (`readk`).
    local wrote = false
    for c = 1, n do
      local level
      if admitted then
        if SG[c] then
          level = SF[c]
        elseif SS[c] then
          level = SW[c]
        end
      elseif SD[c] then
        level = SF[c]
      elseif SS[c] then
        level = SW[c]
      end
      if level ~= nil then
        wrote = true
        -- What the next request on the key reads (`kept` in the header).
        local alg, p1, p2, p3 = SA[c], S1[c], S2[c], S3[c]
        if put(SK[c], alg, p1, p2, p3, level) then
          SW[c] = level
        else
          SW[c] = alg[READ](false, p1, p2, p3, now)
        end
        SS[c] = false
      end
    end
    mc = bytes
    if wrote then
      msame = nil
    else
      msame = out
    end
    return out
  end
end

-- A run of `times` identical requests of n charges on distinct keys, each
-- a plain consume on a key not stored after now whose algorithm has
-- `steps` (see the header; the token bucket without a debt bound): the
-- requests admitted one after the other are as many as fit on every key
-- (the least of the keys' `fits`), each key then written once; the request
-- after them is denied and writes nothing, so the rest of the run repeats
-- its reply. Appends the run's summary (see "Reply" in the header) to
-- `parts` and returns the new count of parts, or false when the run does
-- not qualify (then each request runs on its own; nothing was changed but
-- keys read).
local several_run
if batch and multi and RES == nil then
  -- Per charge: algorithm, key, limit, level, fits, take; the reply's
  -- values. (Made with room for 8 charges: a table that grows is rehashed
  -- at every power of two, which costs more than the work here.)
  local RA, RK, R1, R2, R3 = { nil, nil, nil, nil, nil, nil, nil, nil }, { nil, nil, nil, nil, nil, nil, nil, nil }, { nil, nil, nil, nil, nil, nil, nil, nil }, { nil, nil, nil, nil, nil, nil, nil, nil }, { nil, nil, nil, nil, nil, nil, nil, nil }
  local RW, RF, RT = { nil, nil, nil, nil, nil, nil, nil, nil }, { nil, nil, nil, nil, nil, nil, nil, nil }, { nil, nil, nil, nil, nil, nil, nil, nil }
  local RV = {}
  several_run = function(first, n, times, parts, np)
    -- (A reply of more values than `unpack` can push: request by request.)
    if n > 1000 then
      return false
    end
    if MARK == nil then
      MARK = { nil, nil, nil, nil, nil, nil, nil, nil }
    end
    local pos = first
    local admit = times
    for c = 1, n do
      local a, k, p1, p2, p3, cost, flags
      a, k, p1, p2, p3, cost, flags, pos = sunpack('>I1I3I4I4I4I8I8', packed, pos)
      if flags % 4 ~= 0 or MARK[k] == -first then
        return false
      end
      MARK[k] = -first
      local alg = (ALGORITHMS[a] or MAKE(a))
      local stepsf = alg[STEPS]
      if stepsf == nil then
        return false
      end
      local s = stored(k)
      if s == nil then
        return false
      end
      local w, stale = readk(alg, k, s, p1, p2, p3)
      if stale then
        return false
      end
      local fits, take = stepsf(w, cost, p1, p2, p3, flags / 4)
      if fits == nil then
        return false
      end
      if fits < admit then
        admit = fits
      end
      RA[c], RK[c], R1[c], R2[c], R3[c], RW[c], RF[c], RT[c] = alg, k, p1, p2, p3, w, fits, take
    end
    np = np + 1
    parts[np] = run_summary(times, admit, n, RW, RT, RF, RV)
    if admit > 0 then
      for c = 1, n do
        put(RK[c], RA[c], R1[c], R2[c], R3[c], RW[c] - admit * RT[c])
      end
    end
    -- `several` reads its keys anew.
    mc = nil
    return np
  end
end

-- The packed replies of the requests of a run of one charge from the
-- values V[1..nv]: per request admitted, flags and left, and with a window
-- report (flags bit 1) now and prev.
local function pack_run(V, nv, wide)
  local fmt
  if wide then
    local f, nf, j = { '>' }, 1, 1
    while j <= nv do
      nf = nf + 1
      if V[j + 1] >= 2 then
        f[nf] = 'BBi8I8I8'
        j = j + 5
      else
        f[nf] = 'BBi8'
        j = j + 3
      end
    end
    fmt = table.concat(f)
  else
    fmt = '>' .. srep('BBi8', nv / 3)
  end
  return spack(fmt, unpack(V, 1, nv))
end

local parts, np = {}, 0
local first = 1
-- Reply values of the run being evaluated (reused by every run).
local V = {}
for pos = 1, #sizes, 8 do
  local n, times = sunpack('>I4I4', sizes, pos)
  if n == 1 and RES == nil then
    mc = nil
    local a, k, p1, p2, p3, cost, flags = sunpack('>I1I3I4I4I4I8I8', packed, first)
    local alg = (ALGORITHMS[a] or MAKE(a))
    local s, err = stored(k)
    if s == nil then
      -- Every request of the run fails as its own call would.
      err = ssub(err, 1, 1000)
      np = np + 1
      parts[np] = srep(schar(2) .. spack('>I2', #err) .. err, times)
    else
      local low = flags % 4
      -- Exact: flags < 2^35 and the divisors are powers of two.
      local x = (flags - low) / 4
      local refund, shadow = low % 2 == 1, low >= 2
      local consume, refundf, report, keptf, runf = alg[CONSUME], alg[REFUND], alg[REPORT], alg[KEPT], alg[RUN]
      local w, stale = readk(alg, k, s, p1, p2, p3)
      -- Whether a request of the run wrote the key (then `put` at the end
      -- of the run, with what the last of them left).
      local wrote = false
      local nv, wide = 0, false
      -- The reply of the run's request that wrote nothing, and how many
      -- requests after it repeat it.
      local same, rest
      local fits, take
      if low == 0 and not stale and alg[STEPS] ~= nil then
        fits, take = alg[STEPS](w, cost, p1, p2, p3, x)
      end
      if fits ~= nil then
        -- Plain consumes that the algorithm's steps answer: one summary
        -- for the whole run (see "Reply" in the header).
        local admit = times
        if fits < admit then
          admit = fits
        end
        local enough = 0
        if fits > admit then
          enough = 1
        end
        np = np + 1
        parts[np] = spack('>BI4I4i8I8B', 3, times, admit, w, take, enough)
        if admit > 0 then
          w = w - admit * take
          wrote = true
        end
        times = 0
      elseif runf ~= nil and low == 0 and not stale then
        -- Plain consumes: the algorithm's run (in slices of 200 requests,
        -- within the Lua stack that `unpack` fills), then no loop below.
        local todo = times
        while todo > 0 do
          local m = todo
          if m > 200 then
            m = 200
          end
          local written
          w, nv, written = runf(w, cost, p1, p2, p3, x, m, V, 0)
          if written > 0 then
            wrote = true
          end
          np = np + 1
          parts[np] = pack_run(V, nv, false)
          nv = 0
          if written < m then
            rest = todo - written - 1
            if rest > 0 then
              same = spack('>BBi8', V[written * 3 + 1], V[written * 3 + 2], V[written * 3 + 3])
            end
            break
          end
          todo = todo - m
        end
        times = 0
      end
      for i = 1, times do
        local after, ok, changed, stands
        if refund then
          after, changed = refundf(w, cost, p1, p2, p3, x, now)
          ok = true
        else
          after, ok, changed, stands = consume(w, cost, p1, p2, p3, x)
        end
        local level, adm, left, prev
        if ok or shadow then
          adm = 1
          if changed then
            level = after
          elseif stale then
            level = w
          end
          left, prev = report(after, p1, p2, p3, now)
        else
          adm = 0
          if stands then
            level = after
          elseif stale then
            level = w
          end
          left, prev = report(w, p1, p2, p3, now)
        end
        local enough = ok and 1 or 0
        if prev == nil then
          V[nv + 1], V[nv + 2], V[nv + 3] = adm, enough, left
          nv = nv + 3
        else
          V[nv + 1], V[nv + 2], V[nv + 3], V[nv + 4], V[nv + 5] = adm, enough + 2, left, now, prev
          nv = nv + 5
          wide = true
        end
        if level == nil then
          -- Nothing written: the key holds what this request read, so the
          -- rest of the run repeats its reply.
          if i < times then
            if prev == nil then
              same = spack('>BBi8', adm, enough, left)
            else
              same = spack('>BBi8I8I8', adm, enough + 2, left, now, prev)
            end
            rest = times - i
          end
          break
        end
        -- What the next request reads (`kept` in the header).
        if keptf(level, p1, p2, p3) then
          w = level
        else
          w = alg[READ](false, p1, p2, p3, now)
        end
        stale, wrote = false, true
        if nv > 600 then
          -- (Within the Lua stack that `unpack` fills.)
          np = np + 1
          parts[np] = pack_run(V, nv, wide)
          nv, wide = 0, false
        end
      end
      if wrote then
        put(k, alg, p1, p2, p3, w)
      end
      if nv > 0 then
        np = np + 1
        parts[np] = pack_run(V, nv, wide)
      end
      if same then
        np = np + 1
        parts[np] = srep(same, rest)
      end
    end
  else
    if times > 1 and n > 1 and RES == nil then
      local done = several_run(first, n, times, parts, np)
      if done then
        np, times = done, 0
      end
    end
    for _ = 1, times do
      local reply, err
      if n > 1 and RES == nil then
        reply, err = several(first, n)
        if reply == false then
          reply, err = general(first, n)
        end
      else
        mc = nil
        reply, err = general(first, n)
      end
      if reply == nil then
        err = ssub(err, 1, 1000)
        reply = schar(2) .. spack('>I2', #err) .. err
      end
      np = np + 1
      parts[np] = reply
    end
  end
  first = first + 32 * n
end
flush()
return table.concat(parts)
