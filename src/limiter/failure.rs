//! What a request gets when storage fails: the `--on-storage-error` policy,
//! with failures counted always and logged at most once a second.

use super::DecideError;
use super::plan::Plan;
use super::verdict::{Code, Decision, DescriptorStatus};
use crate::metrics as m;
use crate::settings::OnStorageError;
use crate::storage::StorageError;
use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// At most one "storage call failed" log line per interval (with the count
/// of failures not logged since the previous line).
const STORAGE_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Rate limit on the "storage call failed" log line.
#[derive(Debug, Default)]
pub(super) struct FailureLog {
    /// Last line logged, and failures not logged since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl FailureLog {
    /// Whether to log now; if so, how many failures were not logged since
    /// the last line.
    fn take(&self, now: Instant) -> Option<u64> {
        let mut log = self.state.lock();
        match log.0 {
            Some(last) if now.duration_since(last) < STORAGE_LOG_INTERVAL => {
                log.1 += 1;
                None
            }
            _ => {
                log.0 = Some(now);
                Some(std::mem::take(&mut log.1))
            }
        }
    }
}

/// The answer under `policy` for a request planned as `plans` whose storage
/// call failed with `e`. Fail-open answers never carry a `current_limit`
/// that was not checked. Fail-closed denies only through rules that may
/// deny: not shadow-mode rules, and nothing under the service-wide shadow
/// mode (`global_shadow`), which never denies.
///
/// # Errors
/// [`DecideError::Storage`] under [`OnStorageError::Unavailable`].
pub(super) fn answer(
    policy: OnStorageError,
    global_shadow: bool,
    log: &FailureLog,
    plans: &[Plan],
    e: StorageError,
) -> Result<Decision, DecideError> {
    metrics::counter!(m::STORAGE_ERRORS, "kind" => e.kind().to_owned()).increment(1);
    // An outage at thousands of requests per second must not flood the
    // log; the metric counts every failure.
    if let Some(suppressed) = log.take(Instant::now()) {
        tracing::error!(error = %e, ?policy, suppressed, "storage call failed");
    }
    let may_deny = |p: &Plan| matches!(p, Plan::Limited { shadow: false, .. }) && !global_shadow;
    let with = |limited: DescriptorStatus, overall_code: Code| Decision {
        overall_code,
        statuses: plans
            .iter()
            .map(|p| match p {
                Plan::Unlimited => DescriptorStatus::unlimited(),
                p if may_deny(p) => limited.clone(),
                _ => DescriptorStatus::no_limit(),
            })
            .collect(),
        response_headers_to_add: Vec::new(),
        dynamic_metadata: None,
    };
    match policy {
        OnStorageError::Unavailable => Err(DecideError::Storage(e)),
        OnStorageError::Allow => Ok(with(DescriptorStatus::no_limit(), Code::Ok)),
        OnStorageError::Deny if plans.iter().any(may_deny) => {
            Ok(with(DescriptorStatus::denied_unchecked(), Code::OverLimit))
        }
        OnStorageError::Deny => Ok(with(DescriptorStatus::no_limit(), Code::Ok)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_logged_at_most_once_a_second_with_the_suppressed_count() {
        let log = FailureLog::default();
        let t0 = Instant::now();
        assert_eq!(log.take(t0), Some(0));
        assert_eq!(log.take(t0 + Duration::from_millis(10)), None);
        assert_eq!(log.take(t0 + Duration::from_millis(900)), None);
        assert_eq!(log.take(t0 + Duration::from_millis(1000)), Some(2));
    }

    #[test]
    fn policies_answer_only_the_limited_descriptors() {
        use crate::config::Unit;
        use crate::limiter::verdict::CurrentLimit;
        let limited = |shadow| Plan::Limited {
            charge: 0,
            counters: std::sync::Arc::new(crate::metrics::RuleCounters::new("d.k".into())),
            current: CurrentLimit {
                name: String::new(),
                requests_per_unit: 1,
                unit: Unit::Second,
            },
            cost: 1,
            shadow,
            quota: false,
            metadata: None,
            rule: None,
        };
        let plans = [Plan::NoLimit, limited(false), Plan::Unlimited];
        let log = FailureLog::default();
        let e = || StorageError::CircuitOpen;
        assert!(matches!(
            answer(OnStorageError::Unavailable, false, &log, &plans, e()),
            Err(DecideError::Storage(StorageError::CircuitOpen))
        ));
        let d = answer(OnStorageError::Deny, false, &log, &plans, e()).unwrap();
        assert_eq!(d.overall_code, Code::OverLimit);
        assert_eq!(
            d.statuses,
            vec![
                DescriptorStatus::no_limit(),
                DescriptorStatus::denied_unchecked(),
                DescriptorStatus::unlimited()
            ]
        );
        let d = answer(OnStorageError::Allow, false, &log, &plans, e()).unwrap();
        assert_eq!(d.overall_code, Code::Ok);
        assert_eq!(d.statuses[1], DescriptorStatus::no_limit());
        // Shadow rules, and everything under the service-wide shadow mode,
        // never deny: fail-closed answers OK for them.
        let d = answer(OnStorageError::Deny, true, &log, &plans, e()).unwrap();
        assert_eq!(d.overall_code, Code::Ok);
        assert_eq!(d.statuses[1], DescriptorStatus::no_limit());
        let d = answer(OnStorageError::Deny, false, &log, &[limited(true)], e()).unwrap();
        assert_eq!(d.overall_code, Code::Ok);
    }
}
