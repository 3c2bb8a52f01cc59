//! The decision: one status per descriptor and the overall code, in config
//! units and `std::time::Duration`, for the protocol adapters to encode.
//! Also the step that turns a storage result into statuses and metrics.

use super::plan::Plan;
use crate::config::Metadata;
use crate::config::Unit;
use crate::metrics::{self as m, RuleCounter};
use crate::settings::ServiceSettings;
use crate::storage::algorithm::{self, Report, RequestResult};
use crate::storage::{Charge, ChargeKind};
use std::borrow::Cow;
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
    /// Within the limit: until the key is back to its fresh state (a bucket
    /// full again). Over: until the
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
    /// Name (`retry-after`, `ratelimit-remaining`, or a configured name).
    pub key: Cow<'static, str>,
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
    /// With `--response-dynamic-metadata`: the domain, the request's
    /// descriptors and hits, and the merged `metadata` of the rules not over
    /// their limit (a protobuf `Struct` on the wire).
    pub dynamic_metadata: Option<Metadata>,
}

impl Decision {
    /// An `Ok` decision with `statuses` and no headers.
    #[must_use]
    pub fn ok(statuses: Vec<DescriptorStatus>) -> Self {
        Self {
            overall_code: Code::Ok,
            statuses,
            response_headers_to_add: Vec::new(),
            dynamic_metadata: None,
        }
    }
}

/// Longest wait reported, in microseconds: the largest
/// `google.protobuf.Duration` (315,576,000,000 s, about 10,000 years), so
/// that strict decoders accept every answer. Only a cost near `u64::MAX` on
/// a slow rule with a huge debt bound can ask for more.
pub const MAX_REPORTED_US: u128 = 315_576_000_000 * 1_000_000;

/// A wait of `us` microseconds as sent in `duration_until_reset`: whole
/// seconds rounded up (Envoy reads only seconds), or milliseconds rounded up
/// when `exact` (`--exact-durations`).
#[must_use]
pub fn reported_duration(us: u128, exact: bool) -> Duration {
    let us = us.min(MAX_REPORTED_US);
    if exact {
        let ms = us.div_ceil(1000);
        let secs = u64::try_from(ms / 1000).unwrap_or(u64::MAX);
        let nanos = u32::try_from((ms % 1000) * 1_000_000).unwrap_or(0);
        Duration::new(secs, nanos)
    } else {
        Duration::from_secs(algorithm::ceil_secs(us))
    }
}

/// What [`respond`] found: the decision, and what the headers and the
/// dynamic metadata need.
pub(super) struct Verdict {
    /// The decision, with `retry-after` when denied.
    pub decision: Decision,
    /// Index and unit length (seconds) of every non-shadow status that
    /// carries a limit (for the RateLimit headers).
    pub limited: Vec<(usize, u64)>,
    /// Indices of the statuses that deny the request (the RateLimit headers
    /// describe the longest of them).
    pub denials: Vec<usize>,
    /// Per status, with `--response-dynamic-metadata` (empty otherwise): its
    /// rule lacked the tokens (shadow rules included) or it is a refund, so
    /// its `metadata` is not returned.
    pub over: Vec<bool>,
}

/// Statuses of a request whose charges storage applied (`result`), with
/// the per-rule metrics and `retry-after` when denied.
///
/// A request is denied when a normal (not shadow, not quota) descriptor is
/// over its limit, when it has quota descriptors and every one of them is
/// over, or when storage did not admit it. The wait then is until it would be
/// admitted: the longest wait of the normal denials, and at least the
/// shortest wait of the quota descriptors (one of them having tokens is
/// enough). A denied request was not charged: storage writes nothing for a
/// request it does not admit.
pub(super) fn respond(
    settings: &ServiceSettings,
    plans: &[Plan],
    charges: &[Charge],
    result: &RequestResult,
) -> Verdict {
    let lacks = |charge: usize| charges[charge].spec.kind.takes() && !result.charges[charge].enough;
    let mut normal_over = false;
    let (mut quota_total, mut quota_over) = (0usize, 0usize);
    for p in plans {
        if let Plan::Limited {
            charge,
            shadow: false,
            quota,
            ..
        } = p
        {
            if *quota {
                // A refund asks for nothing: it is no quota to pass on.
                if charges[*charge].spec.kind.takes() {
                    quota_total += 1;
                    quota_over += usize::from(lacks(*charge));
                }
            } else {
                normal_over |= lacks(*charge);
            }
        }
    }
    let quota_denied = quota_total > 0 && quota_over == quota_total;
    // Under `--shadow-mode` a request the rules deny is answered OK anyway
    // (each status keeps its real code, as in the Go service); every charge
    // is a shadow charge in storage then, so storage admitted it.
    let denied = !settings.global_shadow_mode && (normal_over || quota_denied || !result.admitted);
    let charged = result.admitted;

    let mut statuses = Vec::with_capacity(plans.len());
    let mut retry_after_us: u128 = 0;
    // (impossible, wait) of the quota to wait for: the shortest possible one.
    let mut quota_wait: Option<((bool, u128), usize)> = None;
    let mut denials = Vec::new();
    let mut limited: Vec<(usize, u64)> = Vec::new();
    // Only the dynamic metadata reads it.
    let track_over = settings.response_dynamic_metadata;
    let mut over = Vec::with_capacity(if track_over { plans.len() } else { 0 });
    // Quota statuses over their limit in a request that passes limit
    // nothing: the RateLimit headers leave them out.
    let mut spent_quota = Vec::new();
    let need_micro = algorithm::request_needs(charges);
    // A denied request still takes its debt charges; storage reports the
    // balances from before it. Statuses of debt charges report the balance
    // after them, so the wait counts the charge just taken: a client that
    // waits the reported time and sends the same request again is admitted
    // (with the balance before, every retry would be charged again and come
    // back short by its own cost).
    let after_debt = if result.admitted {
        Vec::new()
    } else {
        algorithm::remaining_after_denial(charges, result)
    };
    // Fixed windows count their hits as the Go service does: per charge,
    // the window's count before and after it.
    let window_counts = go_window_counts(charges, result);
    for plan in plans {
        let (charge_idx, counters, current, cost, shadow, quota) = match plan {
            Plan::NoLimit => {
                statuses.push(DescriptorStatus::no_limit());
                if track_over {
                    over.push(false);
                }
                continue;
            }
            Plan::Unlimited => {
                statuses.push(DescriptorStatus::unlimited());
                if track_over {
                    over.push(false);
                }
                continue;
            }
            Plan::Limited {
                charge,
                counters,
                current,
                cost,
                shadow,
                quota,
                ..
            } => (*charge, counters, current, *cost, *shadow, *quota),
        };
        // A refund asks for nothing: like a rule over its limit, it passes
        // on no metadata.
        if track_over {
            over.push(lacks(charge_idx) || charges[charge_idx].spec.kind == ChargeKind::Refund);
        }
        let spec = &charges[charge_idx].spec;
        // Shadow rules never deny and are not announced in headers.
        if !shadow {
            limited.push((statuses.len(), spec.limit.unit_secs()));
        }
        let r = result.charges[charge_idx];
        let limit = &spec.limit;
        let debt_after = after_debt.get(charge_idx).copied().flatten();
        let left_micro = debt_after.unwrap_or(r.remaining_micro);
        let report = Report {
            remaining_micro: left_micro,
            window: r.window,
        };
        // The Go service's statistics of a fixed window (hits before and
        // after this charge against the limit and the near-limit threshold).
        let go = window_counts
            .get(charge_idx)
            .copied()
            .flatten()
            .map(|(before, after)| GoCounts::new(limit, before, after, cost, settings));
        // 0 while in debt.
        let remaining = algorithm::whole(left_micro);
        // A u64 `hits_addend` near its maximum would wrap a counter in one
        // or two requests, and Prometheus reads a counter going down as a
        // reset; one request counts at most u32::MAX hits (the reference
        // service's hits are u32 throughout).
        let counted = cost.min(u64::from(u32::MAX));
        if spec.kind.takes() {
            counters.increment(RuleCounter::Hits, counted);
            counters.increment(
                match (r.enough, shadow || settings.global_shadow_mode) {
                    (true, _) => RuleCounter::RequestOk,
                    (false, false) => RuleCounter::RequestOverLimit,
                    (false, true) => RuleCounter::RequestShadowOverLimit,
                },
                1,
            );
        }
        let status = if spec.kind == ChargeKind::Refund || r.enough {
            if spec.kind.takes() && charged {
                counters.increment(RuleCounter::WithinLimit, counted);
                if let Some(go) = go {
                    counters.increment(RuleCounter::NearLimit, go.near_within());
                } else {
                    let low = (limit.capacity_micro() as f64) * (1.0 - settings.near_limit_ratio);
                    if cost > 0 && (left_micro as f64) < low {
                        counters.increment(RuleCounter::NearLimit, counted);
                    }
                }
            }
            // A debt rule that had enough but was charged in a request
            // another descriptor denied: if the charge leaves it short for
            // the same request again, the retry must wait for it too.
            if let Some(after) = debt_after
                && spec.kind.takes()
                && !shadow
            {
                let need = need_micro[charge_idx].max(spec.own_need_micro());
                if i128::from(after) < i128::try_from(need).unwrap_or(i128::MAX) {
                    retry_after_us = retry_after_us.max(limit.wait_us(&report, need));
                }
            }
            DescriptorStatus {
                code: Code::Ok,
                current_limit: Some(current.clone()),
                limit_remaining: remaining,
                duration_until_reset: Some(reported_duration(
                    limit.reset_us(&report),
                    settings.exact_durations,
                )),
            }
        } else {
            // A fixed window counts only the hits past its limit as over,
            // and the ones between the near-limit threshold and the limit as
            // near (the Go service's `checkOverLimitThreshold`).
            counters.increment(RuleCounter::OverLimit, go.map_or(counted, |g| g.over()));
            if let Some(go) = go {
                counters.increment(RuleCounter::NearLimit, go.near_over());
            }
            let own = spec.own_need_micro();
            if limit.exceeds_capacity(own) {
                counters.increment(RuleCounter::HitsExceedCapacity, counted);
            }
            // Earlier consumes of this request on the same key must fit
            // too: wait until all of them do, not only this one's cost.
            let wait_us = limit.wait_us(&report, need_micro[charge_idx].max(own));
            let code = if shadow {
                counters.increment(RuleCounter::ShadowMode, go.map_or(counted, |g| g.over()));
                Code::Ok
            } else if quota {
                // A quota that can never pass (cost above its burst, or a
                // zero rate) is no reason to come back sooner.
                let possible = limit.can_ever_fit(own);
                let key = (!possible, wait_us);
                if quota_wait.is_none_or(|(k, _)| key < k) {
                    quota_wait = Some((key, statuses.len()));
                }
                spent_quota.push(statuses.len());
                Code::OverLimit
            } else {
                retry_after_us = retry_after_us.max(wait_us);
                denials.push(statuses.len());
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
    if quota_denied && let Some(((_, wait_us), i)) = quota_wait {
        retry_after_us = retry_after_us.max(wait_us);
        denials.push(i);
    }
    if settings.global_shadow_mode && (normal_over || quota_denied) {
        metrics::counter!(m::GLOBAL_SHADOW_MODE).increment(1);
        denials.clear();
        retry_after_us = 0;
    }
    if !denied {
        limited.retain(|(i, _)| !spent_quota.contains(i));
    }
    let mut decision = Decision {
        overall_code: if denied { Code::OverLimit } else { Code::Ok },
        statuses,
        response_headers_to_add: Vec::new(),
        dynamic_metadata: None,
    };
    if denied {
        decision.response_headers_to_add.push(Header {
            key: "retry-after".into(),
            value: algorithm::ceil_secs(retry_after_us.clamp(1, MAX_REPORTED_US)).to_string(),
        });
    }
    Verdict {
        decision,
        limited,
        denials,
        over,
    }
}

/// Per charge, for a consume on a fixed window (a limit that
/// [counts when short](crate::storage::Limit::counts_when_short)): the
/// window's count before and after it, in tokens, as the Go service sees
/// them (`limitBeforeIncrease`, `limitAfterIncrease`): its count before the
/// request plus the earlier consumes of the request on the same key, then
/// plus its own cost. `None` for other charges. Empty when the request has
/// no such charge.
fn go_window_counts(charges: &[Charge], result: &RequestResult) -> Vec<Option<(u64, u64)>> {
    let is_window =
        |c: &Charge| c.spec.kind == ChargeKind::Consume && c.spec.limit.counts_when_short();
    if !charges.iter().any(is_window) {
        return Vec::new();
    }
    // Per key: the costs of its consumes in this request.
    let mut total: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for c in charges.iter().filter(|c| is_window(c)) {
        let t = total.entry(c.key.as_str()).or_default();
        *t = t.saturating_add(c.spec.cost);
    }
    let mut taken: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    charges
        .iter()
        .zip(&result.charges)
        .map(|(c, r)| {
            if !is_window(c) {
                return None;
            }
            let crate::storage::Limit::FixedWindow(l) = c.spec.limit else {
                return None;
            };
            let reported = algorithm::fixed_window::count_of(&l, &r.report());
            // An admitted request reports the counts after every consume on
            // the key, a denied one before any; so does a quota charge that
            // lacked room in a request that passed without it (its answer is
            // the denied round's: a non-shadow consume that lacked).
            let reported_before = !result.admitted || (!r.enough && !c.spec.shadow);
            let start = if reported_before {
                reported
            } else {
                reported.saturating_sub(total.get(c.key.as_str()).copied().unwrap_or(0))
            };
            let so_far = taken.entry(c.key.as_str()).or_default();
            let before = start.saturating_add(*so_far);
            *so_far = so_far.saturating_add(c.spec.cost);
            Some((before, before.saturating_add(c.spec.cost)))
        })
        .collect()
}

/// One fixed-window charge's statistics as the Go service counts them
/// (`src/limiter/base_limiter.go`: `GetResponseDescriptorStatus`,
/// `checkOverLimitThreshold`, `checkNearLimitThreshold`,
/// `increaseShadowModeStats`): hits split by where the count was before and
/// after them against the limit and the near-limit threshold
/// (`floor(limit × near_limit_ratio)` in 32-bit floats, as Go computes it).
#[derive(Clone, Copy, Debug)]
struct GoCounts {
    limit: u64,
    near: u64,
    before: u64,
    after: u64,
    hits: u64,
}

impl GoCounts {
    fn new(
        limit: &crate::storage::Limit,
        before: u64,
        after: u64,
        cost: u64,
        settings: &ServiceSettings,
    ) -> Self {
        let n = limit.capacity_micro() / u128::from(algorithm::MICRO);
        let n = u64::try_from(n).unwrap_or(u64::MAX);
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let near = ((n as f32) * (settings.near_limit_ratio as f32)).floor() as u64;
        Self {
            limit: n,
            near,
            before,
            after,
            hits: cost.min(u64::from(u32::MAX)),
        }
    }

    /// Hits over the limit: all of them when the count was already at the
    /// limit, else the part past it.
    fn over(self) -> u64 {
        if self.before >= self.limit {
            self.hits
        } else {
            self.after.saturating_sub(self.limit).min(self.hits)
        }
    }

    /// Near-limit hits of a charge over the limit: the part between the
    /// threshold (or the count before, if higher) and the limit.
    fn near_over(self) -> u64 {
        if self.before >= self.limit {
            0
        } else {
            self.limit.saturating_sub(self.near.max(self.before))
        }
    }

    /// Near-limit hits of a charge within the limit: the part above the
    /// threshold.
    fn near_within(self) -> u64 {
        if self.after <= self.near {
            0
        } else if self.before >= self.near {
            self.hits
        } else {
            self.after - self.near
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_are_reported_within_the_protobuf_duration_range() {
        let max = Duration::from_secs(315_576_000_000);
        assert_eq!(reported_duration(u128::MAX, false), max);
        assert_eq!(reported_duration(u128::MAX, true), max);
        assert_eq!(reported_duration(1, false), Duration::from_secs(1));
    }

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
