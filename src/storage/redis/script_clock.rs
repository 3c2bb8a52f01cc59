//! The clock the request script reads (`TIME` inside a script), checked
//! before a backend serves from a node it has (re)connected to.
//!
//! Buckets take their time from the engine so replicas never disagree
//! (docs/design.md, "Time"). An engine whose scripts see a wrong time would
//! make every bucket wrong without an error: Dragonfly answers `TIME`
//! inside a script with zeros (dragonfly #2555), and some managed services
//! refuse `TIME` in scripts. So the first call after a (re)connection, a
//! failover or a script reload first runs [`CHECK_SCRIPT`] and compares its
//! answer with this host's clock ([`judge`]); on a bad answer every call
//! fails at once with a [`BackendKind::Clock`] error that names the engine
//! problem (so `/healthcheck` reports it), and the check is repeated at
//! most once per [`RECHECK_AFTER`].

use crate::storage::{BackendKind, StorageError};
use parking_lot::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The check: the script's `TIME`, as the request script reads it.
pub const CHECK_SCRIPT: &str = "return redis.call('TIME')";

/// Most seconds the script's clock may differ from this host's: far more
/// than two NTP-synchronised clocks ever differ, far less than a zero
/// clock, a frozen one or one in the wrong unit.
pub const MAX_SKEW_SECS: u64 = 300;

/// Time between two checks while the clock is bad (calls in between fail
/// at once with the last reason).
pub const RECHECK_AFTER: Duration = Duration::from_secs(1);

/// Judges the script's answer to [`CHECK_SCRIPT`] against this host's
/// clock, both in microseconds since the Unix epoch. `script_us` is `Err`
/// with the engine's message when the script could not read `TIME`.
///
/// # Errors
/// Why the script's clock cannot be used, naming the engine problem.
pub fn judge(script_us: Result<u64, String>, host_us: u64) -> Result<(), String> {
    let script_us = script_us.map_err(|e| {
        format!(
            "the Redis engine refused the clock check, TIME inside a Lua script ({e}); the \
             buckets need the engine's clock in scripts (some managed services forbid it): \
             allow TIME in scripts, or use Redis or Valkey"
        )
    })?;
    if script_us == 0 {
        return Err(
            "the Redis engine answers TIME inside a Lua script with 0 (Dragonfly does); the \
             buckets need the engine's clock in scripts: use Redis or Valkey"
                .to_owned(),
        );
    }
    let skew_secs = script_us.abs_diff(host_us) / 1_000_000;
    if skew_secs > MAX_SKEW_SECS {
        return Err(format!(
            "TIME inside a Lua script is {skew_secs} s away from this host's clock (more than \
             {MAX_SKEW_SECS} s): the engine's clock in scripts is wrong; fix the engine's clock \
             (or this host's) before serving from it"
        ));
    }
    Ok(())
}

/// Parses the reply of [`CHECK_SCRIPT`] (`[seconds, microseconds]`) into
/// microseconds; `None` for any other shape.
#[must_use]
pub fn parse_reply(v: &::redis::Value) -> Option<u64> {
    let ::redis::Value::Array(parts) = v else {
        return None;
    };
    let [secs, micros] = parts.as_slice() else {
        return None;
    };
    let num = |v: &::redis::Value| -> Option<u64> {
        match v {
            ::redis::Value::Int(n) => u64::try_from(*n).ok(),
            ::redis::Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
            _ => None,
        }
    };
    num(secs)?.checked_mul(1_000_000)?.checked_add(num(micros)?)
}

/// This host's clock in microseconds since the Unix epoch.
#[must_use]
pub fn host_now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// What a backend knows about its script clock.
#[derive(Debug, Default)]
pub(crate) struct ScriptClock {
    state: Mutex<State>,
}

#[derive(Debug, Default, Clone)]
enum State {
    /// Not checked since the last (re)connection.
    #[default]
    Unchecked,
    /// Checked and good.
    Good,
    /// Checked and bad, at `at`.
    Bad { why: String, at: Instant },
}

/// What the next call must do about the clock.
pub(crate) enum Gate {
    /// Go ahead.
    Pass,
    /// Run the check first.
    Check,
    /// Fail with this error.
    Refuse(StorageError),
}

impl ScriptClock {
    /// What the next call must do.
    pub(crate) fn gate(&self) -> Gate {
        match &*self.state.lock() {
            State::Good => Gate::Pass,
            State::Unchecked => Gate::Check,
            State::Bad { at, .. } if at.elapsed() >= RECHECK_AFTER => Gate::Check,
            State::Bad { why, .. } => Gate::Refuse(refusal(why)),
        }
    }

    /// Records a check's verdict; the error to fail with when bad.
    pub(crate) fn record(&self, verdict: Result<(), String>) -> Result<(), StorageError> {
        let mut state = self.state.lock();
        match verdict {
            Ok(()) => {
                *state = State::Good;
                Ok(())
            }
            Err(why) => {
                if !matches!(&*state, State::Bad { why: old, .. } if *old == why) {
                    tracing::error!(%why, "refusing to serve from this Redis backend");
                }
                let e = refusal(&why);
                *state = State::Bad {
                    why,
                    at: Instant::now(),
                };
                Err(e)
            }
        }
    }

    /// Forgets the verdict: the next call checks again (after a connection
    /// failure, a failover or a script reload: the node may be another).
    pub(crate) fn forget(&self) {
        let mut state = self.state.lock();
        if matches!(*state, State::Good) {
            *state = State::Unchecked;
        }
    }
}

fn refusal(why: &str) -> StorageError {
    StorageError::backend(BackendKind::Clock, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000_000_000;

    #[test]
    fn a_zero_clock_is_refused_naming_the_engine_problem() {
        let e = judge(Ok(0), NOW).unwrap_err();
        assert!(e.contains("TIME inside a Lua script with 0"), "{e}");
    }

    #[test]
    fn a_refused_time_is_refused_with_the_engines_message() {
        let e = judge(Err("ERR command not allowed".into()), NOW).unwrap_err();
        assert!(
            e.contains("refused the clock check") && e.contains("command not allowed"),
            "{e}"
        );
    }

    #[test]
    fn skew_up_to_the_bound_passes_and_beyond_it_is_refused() {
        let bound = MAX_SKEW_SECS * 1_000_000;
        assert_eq!(judge(Ok(NOW), NOW), Ok(()));
        assert_eq!(judge(Ok(NOW + bound), NOW), Ok(()));
        assert_eq!(judge(Ok(NOW - bound), NOW), Ok(()));
        let e = judge(Ok(NOW + bound + 1_000_000), NOW).unwrap_err();
        assert!(e.contains("301 s away"), "{e}");
        assert!(judge(Ok(NOW - bound - 1_000_000), NOW).is_err());
        // Milliseconds taken for seconds: far in the future.
        assert!(judge(Ok(NOW * 1000), NOW).is_err());
    }

    #[test]
    fn replies_parse_as_seconds_and_microseconds() {
        use ::redis::Value;
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert_eq!(
            parse_reply(&Value::Array(vec![bulk("1800000000"), bulk("123456")])),
            Some(1_800_000_000_123_456)
        );
        assert_eq!(
            parse_reply(&Value::Array(vec![Value::Int(0), Value::Int(0)])),
            Some(0)
        );
        assert_eq!(parse_reply(&Value::Array(vec![bulk("1")])), None);
        assert_eq!(parse_reply(&Value::Nil), None);
    }

    #[test]
    fn a_bad_clock_refuses_calls_until_a_recheck_and_a_reconnect_checks_again() {
        let c = ScriptClock::default();
        assert!(matches!(c.gate(), Gate::Check));
        assert!(c.record(Err("zero".into())).is_err());
        match c.gate() {
            Gate::Refuse(e) => {
                assert_eq!(e.backend_kind(), Some(BackendKind::Clock));
                assert!(e.to_string().contains("zero"), "{e}");
            }
            _ => panic!("refused at once"),
        }
        // A reconnect does not clear a bad verdict: only a recheck does.
        c.forget();
        assert!(matches!(c.gate(), Gate::Refuse(_)));
        assert!(c.record(Ok(())).is_ok());
        assert!(matches!(c.gate(), Gate::Pass));
        c.forget();
        assert!(matches!(c.gate(), Gate::Check));
    }
}
