//! The decision: one status per descriptor and the overall code, in config
//! units and `std::time::Duration`, for the protocol adapters to encode.
//! Also the step that turns a storage result into statuses and metrics.

use super::plan::Plan;
use crate::config::Unit;
use crate::metrics as m;
use crate::settings::ServiceSettings;
use crate::storage::bucket::{self, MICRO, RequestResult};
use crate::storage::{Charge, ChargeKind};
use std::time::Duration;

/// `limit_remaining` for `unlimited` rules (the Go reference service's value).
pub const UNLIMITED_REMAINING: u32 = u32::MAX;

/// A descriptor's or a request's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    /// Within the limit (or no limit applies).
    Ok,
    /// Over the limit: the request is denied.
    OverLimit,
}

/// The limit a status was computed against (Envoy's `current_limit`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CurrentLimit {
    /// `rate_limit.name` of the rule; empty when it has none.
    pub name: String,
    /// Tokens per unit.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

/// The answer for one descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescriptorStatus {
    /// This descriptor's code (a shadow rule's is always `Ok`).
    pub code: Code,
    /// The limit applied; `None` when no rule applied (or storage failed
    /// and the policy answered without checking).
    pub current_limit: Option<CurrentLimit>,
    /// Whole tokens left; 0 when over; [`UNLIMITED_REMAINING`] for `unlimited`.
    pub limit_remaining: u32,
    /// Within the limit: until the bucket is full again. Over: until the
    /// request would be admitted. Whole seconds rounded up, or milliseconds
    /// rounded up with `exact_durations`.
    pub duration_until_reset: Option<Duration>,
}

impl DescriptorStatus {
    /// `Ok` with no limit (no rule, replaced, unknown domain, fail-open).
    #[must_use]
    pub const fn no_limit() -> Self {
        Self {
            code: Code::Ok,
            current_limit: None,
            limit_remaining: 0,
            duration_until_reset: None,
        }
    }

    /// `Ok` for an `unlimited: true` rule.
    #[must_use]
    pub const fn unlimited() -> Self {
        Self {
            code: Code::Ok,
            current_limit: None,
            limit_remaining: UNLIMITED_REMAINING,
            duration_until_reset: None,
        }
    }

    /// `OverLimit` with no limit (the fail-closed storage policy).
    #[must_use]
    pub const fn denied_unchecked() -> Self {
        Self {
            code: Code::OverLimit,
            current_limit: None,
            limit_remaining: 0,
            duration_until_reset: None,
        }
    }
}

/// A header for the client's response (`response_headers_to_add`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Lower-case name (`retry-after`, `ratelimit-remaining`, ...).
    pub key: &'static str,
    /// Value.
    pub value: String,
}

/// The answer to one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// `OverLimit` when any non-shadow descriptor is over.
    pub overall_code: Code,
    /// One status per request descriptor, in order.
    pub statuses: Vec<DescriptorStatus>,
    /// `retry-after` on `OverLimit`, and the optional RateLimit headers.
    pub response_headers_to_add: Vec<Header>,
}

impl Decision {
    /// An `Ok` decision with `statuses` and no headers.
    #[must_use]
    pub fn ok(statuses: Vec<DescriptorStatus>) -> Self {
        Self {
            overall_code: Code::Ok,
            statuses,
            response_headers_to_add: Vec::new(),
        }
    }
}

/// A wait of `us` microseconds as sent in `duration_until_reset`: whole
/// seconds rounded up (Envoy reads only seconds), or milliseconds rounded up
/// when `exact` (`--exact-durations`).
#[must_use]
pub fn reported_duration(us: u128, exact: bool) -> Duration {
    if exact {
        let ms = us.div_ceil(1000);
        let secs = u64::try_from(ms / 1000).unwrap_or(u64::MAX);
        let nanos = u32::try_from((ms % 1000) * 1_000_000).unwrap_or(0);
        Duration::new(secs, nanos)
    } else {
        Duration::from_secs(bucket::ceil_secs(us))
    }
}

/// Statuses of a request whose charges storage applied (`result`), with
/// the per-rule metrics, `retry-after` on `OverLimit`, and the index and
/// unit length (seconds) of every non-shadow status that carries a limit
/// (for the RateLimit headers).
pub(super) fn respond(
    settings: &ServiceSettings,
    plans: &[Plan],
    charges: &[Charge],
    result: &RequestResult,
) -> (Decision, Vec<(usize, u64)>) {
    let mut statuses = Vec::with_capacity(plans.len());
    let mut over = false;
    let mut retry_after_us: u128 = 0;
    let mut limited: Vec<(usize, u64)> = Vec::new();
    let need_micro = bucket::request_needs(charges);
    for plan in plans {
        let (charge_idx, label, current, cost) = match plan {
            Plan::NoLimit => {
                statuses.push(DescriptorStatus::no_limit());
                continue;
            }
            Plan::Unlimited => {
                statuses.push(DescriptorStatus::unlimited());
                continue;
            }
            Plan::Limited {
                charge,
                label,
                current,
                cost,
            } => (*charge, label, current, *cost),
        };
        let spec = &charges[charge_idx].spec;
        // Shadow rules never deny and are not announced in headers.
        if !spec.shadow {
            limited.push((statuses.len(), spec.limit.unit_secs.get()));
        }
        let r = result.charges[charge_idx];
        let limit = &spec.limit;
        let remaining = u32::try_from(r.tokens_micro / MICRO).unwrap_or(u32::MAX);
        // A u64 `hits_addend` near its maximum would wrap a counter in one
        // or two requests, and Prometheus reads a counter going down as a
        // reset; one request counts at most u32::MAX hits (the reference
        // service's hits are u32 throughout).
        let counted = cost.min(u64::from(u32::MAX));
        if spec.kind == ChargeKind::Consume {
            metrics::counter!(m::TOTAL_HITS, "rule" => label.clone()).increment(counted);
        }
        let status = if spec.kind == ChargeKind::Refund || r.enough {
            if spec.kind == ChargeKind::Consume && result.admitted {
                metrics::counter!(m::WITHIN_LIMIT, "rule" => label.clone()).increment(counted);
                let cap = limit.capacity_micro();
                let low = (cap as f64) * (1.0 - settings.near_limit_ratio);
                if cost > 0 && (r.tokens_micro as f64) < low {
                    metrics::counter!(m::NEAR_LIMIT, "rule" => label.clone()).increment(counted);
                }
            }
            DescriptorStatus {
                code: Code::Ok,
                current_limit: Some(current.clone()),
                limit_remaining: remaining,
                duration_until_reset: Some(reported_duration(
                    bucket::time_to_full_us(limit, r.tokens_micro),
                    settings.exact_durations,
                )),
            }
        } else {
            metrics::counter!(m::OVER_LIMIT, "rule" => label.clone()).increment(counted);
            let own = u128::from(spec.cost.max(1)) * u128::from(MICRO);
            if limit.requests_per_unit > 0 && own > limit.capacity_micro() {
                metrics::counter!(m::HITS_EXCEED_CAPACITY, "rule" => label.clone())
                    .increment(counted);
            }
            // Earlier consumes of this request on the same bucket must fit
            // too: wait until all of them do, not only this one's cost.
            let wait_us =
                bucket::wait_until_fits_us(limit, r.tokens_micro, need_micro[charge_idx].max(own));
            let code = if spec.shadow {
                metrics::counter!(m::SHADOW_MODE, "rule" => label.clone()).increment(counted);
                Code::Ok
            } else {
                over = true;
                retry_after_us = retry_after_us.max(wait_us);
                Code::OverLimit
            };
            DescriptorStatus {
                code,
                current_limit: Some(current.clone()),
                limit_remaining: 0,
                duration_until_reset: Some(reported_duration(wait_us, settings.exact_durations)),
            }
        };
        statuses.push(status);
    }
    let mut decision = Decision {
        overall_code: if over { Code::OverLimit } else { Code::Ok },
        statuses,
        response_headers_to_add: Vec::new(),
    };
    if over {
        decision.response_headers_to_add.push(Header {
            key: "retry-after",
            value: bucket::ceil_secs(retry_after_us).to_string(),
        });
    }
    (decision, limited)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_up_to_seconds_or_to_milliseconds() {
        assert_eq!(reported_duration(1, false), Duration::from_secs(1));
        assert_eq!(reported_duration(1_000_000, false), Duration::from_secs(1));
        assert_eq!(reported_duration(1_000_001, false), Duration::from_secs(2));
        assert_eq!(reported_duration(1, true), Duration::from_millis(1));
        assert_eq!(
            reported_duration(1_500_000, true),
            Duration::from_millis(1500)
        );
        assert_eq!(
            reported_duration(1_500_001, true),
            Duration::from_millis(1501)
        );
        assert_eq!(reported_duration(0, false), Duration::ZERO);
    }
}
