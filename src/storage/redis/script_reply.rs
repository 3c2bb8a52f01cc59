//! Parsing of the request script's packed reply (lua/request.lua,
//! "Reply"): one request's, a batch's runs, and the error of one request
//! of a batch.

use super::BatchItemError;
use crate::storage::algorithm::{ChargeResult, RequestResult, ReservationOutcome, WindowReport};
use crate::storage::{BackendKind, StorageError};
use ::redis::{ErrorKind, RedisError, Value};
use smallvec::SmallVec;

/// Parses the packed reply (admitted, then per charge enough and tokens)
/// for `charges` charges.
///
/// # Errors
/// [`StorageError::Backend`] (`reply`) when the reply has another shape.
pub(crate) fn parse_reply(reply: &Value, charges: usize) -> Result<RequestResult, StorageError> {
    let bad = |what: &str| {
        StorageError::backend(
            BackendKind::Reply,
            format!("unexpected token bucket script reply ({what}): {reply:?}"),
        )
    };
    let Value::BulkString(bytes) = reply else {
        return Err(bad("not a string"));
    };
    parse_packed(bytes, charges).map_err(bad)
}

/// Flag of a charge's reply byte: it had enough.
const REPLY_ENOUGH: u8 = 1;
/// Flag of a charge's reply byte: a window report (16 bytes) follows what
/// is left.
const REPLY_WINDOW: u8 = 2;
/// Bits of a charge's reply byte: the [`ReservationOutcome::code`].
const REPLY_OUTCOME: u8 = 0x1c;
/// Flag of a charge's reply byte: the expired reservations it dropped
/// (4 bytes) follow.
const REPLY_EXPIRED: u8 = 0x20;

/// One request's packed reply: the admitted byte, then per charge a flags
/// byte (enough, window) and what is left as a big-endian i64, and for a
/// window charge the evaluation time and the previous window's count as
/// big-endian u64s (lua/request.lua, "Reply"); `Err` names what is wrong.
pub(super) fn parse_packed(bytes: &[u8], charges: usize) -> Result<RequestResult, &'static str> {
    let (result, used) = parse_one(bytes, charges)?;
    if used != bytes.len() {
        return Err("wrong length");
    }
    Ok(result)
}

/// The reply of a run of identical requests of `charges` charges each,
/// answered at once (lua/request.lua, "Reply", flag 3) at the start of
/// `bytes`: each request's result is appended to `out`; returns the bytes
/// it takes. `left`: how many of the call's next requests have `charges`
/// charges (a run answers at most that many).
pub(super) fn parse_run(
    bytes: &[u8],
    charges: usize,
    left: usize,
    out: &mut Vec<Result<RequestResult, BatchItemError>>,
) -> Result<usize, &'static str> {
    let u32_at = |at: usize| -> Result<u32, &'static str> {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or("run length")
    };
    let times = u32_at(1)? as usize;
    let admitted = u32_at(5)? as usize;
    if times == 0 || times > left || admitted > times {
        return Err("run count");
    }
    let len = 9 + 17 * charges;
    let body = bytes.get(9..len).ok_or("run length")?;
    // Per charge: what the key had at the run's start (micro-units), what
    // each admitted request takes, and whether it had enough for the
    // first request denied.
    let mut per: SmallVec<[(i64, i64, bool); 4]> = SmallVec::with_capacity(charges);
    for c in body.chunks_exact(17) {
        let start = i64::from_be_bytes(c[0..8].try_into().map_err(|_| "run length")?);
        let take = i64::from_be_bytes(c[8..16].try_into().map_err(|_| "run length")?);
        let enough = match c[16] {
            0 => false,
            1 => true,
            _ => return Err("run enough flag"),
        };
        // What the last admitted request leaves: when it fits, so does
        // every value computed below.
        let after = i64::try_from(admitted)
            .ok()
            .and_then(|a| take.checked_mul(a))
            .and_then(|t| start.checked_sub(t));
        if take <= 0 || after.is_none() {
            return Err("run amounts");
        }
        per.push((start, take, enough));
    }
    for j in 1..=times {
        let is_admitted = j <= admitted;
        let taken = i64::try_from(j.min(admitted)).map_err(|_| "run count")?;
        let charges = per
            .iter()
            .map(|&(start, take, enough)| ChargeResult {
                enough: is_admitted || enough,
                remaining_micro: start - taken * take,
                window: None,
                reservation: ReservationOutcome::None,
                expired: 0,
            })
            .collect();
        out.push(Ok(RequestResult {
            admitted: is_admitted,
            charges,
        }));
    }
    Ok(len)
}

/// The reply of one request of `charges` charges at the start of `bytes`,
/// and the bytes it takes.
pub(super) fn parse_one(
    bytes: &[u8],
    charges: usize,
) -> Result<(RequestResult, usize), &'static str> {
    let admitted = match bytes.first() {
        Some(0) => false,
        Some(1) => true,
        Some(_) => return Err("admitted flag"),
        None => return Err("wrong length"),
    };
    let mut pos = 1;
    let mut out = Vec::with_capacity(charges);
    let word = |at: usize| -> Result<[u8; 8], &'static str> {
        bytes
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .ok_or("wrong length")
    };
    for _ in 0..charges {
        let flags = *bytes.get(pos).ok_or("wrong length")?;
        if flags & !(REPLY_ENOUGH | REPLY_WINDOW | REPLY_OUTCOME | REPLY_EXPIRED) != 0 {
            return Err("enough flag");
        }
        let reservation = ReservationOutcome::from_code((flags & REPLY_OUTCOME) >> 2)
            .ok_or("reservation outcome")?;
        let remaining_micro = i64::from_be_bytes(word(pos + 1)?);
        pos += 9;
        let window = if flags & REPLY_WINDOW == 0 {
            None
        } else {
            let at_us = u64::from_be_bytes(word(pos)?);
            let previous_micro = u64::from_be_bytes(word(pos + 8)?);
            pos += 16;
            Some(WindowReport {
                at_us,
                previous_micro,
            })
        };
        let expired = if flags & REPLY_EXPIRED == 0 {
            0
        } else {
            let b = bytes.get(pos..pos + 4).ok_or("wrong length")?;
            pos += 4;
            u32::from_be_bytes([b[0], b[1], b[2], b[3]])
        };
        out.push(ChargeResult {
            enough: flags & REPLY_ENOUGH != 0,
            remaining_micro,
            window,
            reservation,
            expired,
        });
    }
    Ok((
        RequestResult {
            admitted,
            charges: out,
        },
        pos,
    ))
}

/// The Redis error of `text` (`WRONGTYPE Operation against ...`), as the
/// client reports a server error reply with that text.
pub(super) fn server_error(text: &[u8]) -> RedisError {
    let mut wire = Vec::with_capacity(text.len() + 3);
    wire.push(b'-');
    wire.extend(
        text.iter()
            .map(|&b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
    );
    wire.extend_from_slice(b"\r\n");
    match ::redis::parse_redis_value(&wire).and_then(Value::extract_error) {
        Err(e) => e,
        Ok(_) => RedisError::from((
            ErrorKind::Extension,
            "script error",
            String::from_utf8_lossy(text).into_owned(),
        )),
    }
}
