//! One bucket of a quota stream, outside the stream's state: the bucket id
//! checked and put in canonical order, the rule it reaches in the domain
//! (and what that makes of it: a blanket rule or a budget), the subscriber
//! record's name and demand as storage keeps them, the live subscribers as
//! the sharing sees them, and the conversions between a share, Envoy's
//! action and what storage records.

use super::share::{self, Budget, Share, Subscriber};
use super::{Action, Bounds, BucketId, DEBT_SECS, QuotaError, Unmatched};
use crate::config::{Config, Policy};
use crate::limiter::Limiter;
use crate::matcher;
use crate::storage::key::{self, KeyValue};
use crate::storage::quota::{Held, QuotaReport, QuotaView, UNMEASURED_DEMAND};
use crate::storage::{AlgorithmKind, BucketLimit, Limit, WindowLimit};

/// The subscriber id of one bucket id of a stream: the stream's id and a
/// 64-bit digest of the bucket id (SHA-256 of its length-prefixed entries),
/// so that the bucket ids of one stream that share a storage key (a
/// `share_threshold` rule) are subscribers of their own, and the record
/// names stay short whatever the bucket id's size.
pub(super) fn per_bucket(subscriber: &str, id: &BucketId) -> String {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    for (k, v) in id {
        h.update((k.len() as u64).to_be_bytes());
        h.update(k.as_bytes());
        h.update((v.len() as u64).to_be_bytes());
        h.update(v.as_bytes());
    }
    let d = h.finalize();
    format!("{subscriber}/{}", hex::encode(&d[..8]))
}

/// A demand as storage records it ([`UNMEASURED_DEMAND`]: not measured).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
pub(super) fn demand_milli(demand: Option<f64>) -> u64 {
    demand.map_or(UNMEASURED_DEMAND, |d| {
        ((d * 1000.0).round() as u64).min(UNMEASURED_DEMAND - 1)
    })
}

/// A recorded demand, requests a second (`None`: not measured).
#[allow(clippy::cast_precision_loss)]
pub(super) fn demand_of(milli: u64) -> Option<f64> {
    (milli < UNMEASURED_DEMAND).then(|| milli as f64 / 1000.0)
}

/// How one bucket resolved against the config.
pub(super) enum Resolved {
    Blanket(Action, Option<String>),
    Limited {
        rule_label: String,
        key: String,
        limit: Limit,
        budget: Budget,
    },
}

/// The live subscribers of `view` as the sharing sees them, in subscriber
/// id order (the same on every replica, so that the rounding of the shares,
/// largest remainders with ties to the first, hands the same units to the
/// same subscribers), the reporting one included (added when storage listed
/// no record of it), and its index. An unmeasured demand counts as the mean
/// of the measured ones ([`share::with_unmeasured`]).
pub(super) fn subscribers(view: &QuotaView, report: &QuotaReport) -> (Vec<Subscriber>, usize) {
    let mut ids: Vec<(&str, u64, Option<Share>)> = view
        .subscribers
        .iter()
        .map(|s| {
            let current = s.held.map(|h| Share {
                tokens_per_fill: u64::from(h.tokens_per_fill),
                max_tokens: u64::from(h.max_tokens),
            });
            (s.id.as_str(), s.demand_milli, current)
        })
        .collect();
    if !ids.iter().any(|(id, ..)| *id == report.subscriber) {
        ids.push((report.subscriber.as_str(), report.demand_milli, None));
    }
    ids.sort_by(|a, b| a.0.cmp(b.0));
    let me = ids
        .iter()
        .position(|(id, ..)| *id == report.subscriber)
        .unwrap_or(0);
    let demands: Vec<Option<f64>> = ids.iter().map(|&(_, d, _)| demand_of(d)).collect();
    let subs = share::with_unmeasured(&demands)
        .into_iter()
        .zip(&ids)
        .map(|(demand, &(_, _, current))| Subscriber { demand, current })
        .collect();
    (subs, me)
}

/// The bucket id's entries, checked against `bounds` and sorted by key.
pub(super) fn canonical(entries: &[(&str, &str)], bounds: &Bounds) -> Result<BucketId, QuotaError> {
    if entries.is_empty() {
        return Err(QuotaError::Invalid("a bucket id has no entries".into()));
    }
    if entries.len() > bounds.max_entries {
        return Err(QuotaError::Invalid(format!(
            "a bucket id has {} entries, more than {}",
            entries.len(),
            bounds.max_entries
        )));
    }
    let mut id: BucketId = Vec::with_capacity(entries.len());
    for (k, v) in entries {
        if k.is_empty() {
            return Err(QuotaError::Invalid("a bucket id has an empty key".into()));
        }
        if k.len() > bounds.max_text_bytes || v.len() > bounds.max_text_bytes {
            return Err(QuotaError::Invalid(format!(
                "a bucket id key or value is longer than {} bytes",
                bounds.max_text_bytes
            )));
        }
        id.push(((*k).to_owned(), (*v).to_owned()));
    }
    id.sort();
    if id.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(QuotaError::Invalid("a bucket id repeats a key".into()));
    }
    Ok(id)
}

/// `key=value,key=value` (sorted): a bucket's name in the admin view.
pub(super) fn id_label(id: &BucketId) -> String {
    id.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The bucket id's rule in `domain`, and what that makes of it.
pub(super) fn resolve(limiter: &Limiter, config: &Config, domain: &str, id: &BucketId) -> Resolved {
    let unmatched = match limiter.quotas.unmatched {
        Unmatched::Allow => Action::AllowAll,
        Unmatched::Deny => Action::DenyAll,
    };
    let Some(d) = config.domains.get(domain) else {
        return Resolved::Blanket(unmatched, None);
    };
    let entries: Vec<(&str, &str)> = id.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let Some(found) = matcher::find_unordered(&d.root, &entries) else {
        return Resolved::Blanket(unmatched, None);
    };
    let rule = &d.rules[found.matched.rule];
    let label = Some(rule.path.clone());
    let Policy::Limited {
        requests_per_unit,
        unit,
        burst,
        algorithm,
        ..
    } = rule.policy
    else {
        return Resolved::Blanket(Action::AllowAll, label);
    };
    if rule.shadow_mode || limiter.settings.global_shadow_mode {
        return Resolved::Blanket(Action::AllowAll, label);
    }
    let Some(budget) = Budget::new(requests_per_unit, unit.secs(), burst) else {
        return Resolved::Blanket(Action::DenyAll, label);
    };
    let ordered: Vec<(&str, KeyValue<'_>)> = found
        .order
        .iter()
        .zip(&found.matched.shared)
        .map(|(&i, s)| {
            let (k, v) = entries[i];
            (k, s.map_or(KeyValue::Value(v), KeyValue::Shared))
        })
        .collect();
    let key = key::encode(&limiter.settings.key_prefix, &d.name, &ordered);
    let rate_debt = u64::from(requests_per_unit)
        .saturating_mul(DEBT_SECS)
        .div_ceil(unit.secs().max(1));
    // What the Envoys admitted is charged whatever it finds: a bucket
    // with debt, a window that counts what it has no room for.
    let limit = match algorithm {
        AlgorithmKind::TokenBucket => Limit::TokenBucket(BucketLimit {
            requests_per_unit,
            unit_secs: unit.secs_nonzero(),
            burst,
            max_debt: u32::try_from(u64::from(burst).saturating_add(rate_debt)).unwrap_or(u32::MAX),
        }),
        AlgorithmKind::FixedWindow => Limit::FixedWindow(WindowLimit::counting(
            requests_per_unit,
            unit.secs_nonzero(),
        )),
        AlgorithmKind::SlidingWindow => Limit::SlidingWindow(WindowLimit::counting(
            requests_per_unit,
            unit.secs_nonzero(),
        )),
    };
    Resolved::Limited {
        rule_label: rule.path.clone(),
        key,
        limit,
        budget,
    }
}

/// What an action holds of a rule's budget (`None`: a blanket allow).
pub(super) fn held_of(action: Action) -> Option<Held> {
    match action {
        Action::TokenBucket {
            max_tokens,
            tokens_per_fill,
            ..
        } => Some(Held {
            tokens_per_fill,
            max_tokens,
        }),
        Action::DenyAll => Some(Held::default()),
        Action::AllowAll => None,
    }
}

/// A rule's budget as storage records it (each field at most `u32::MAX`).
pub(super) fn budget_held(budget: &Budget) -> Held {
    Held {
        tokens_per_fill: u32::try_from(budget.tokens_per_fill).unwrap_or(u32::MAX),
        max_tokens: u32::try_from(budget.max_tokens).unwrap_or(u32::MAX),
    }
}

/// A share as Envoy's action: a token bucket with the rule's fill
/// interval, or deny-all for a share that holds no token.
pub(super) fn to_action(s: Share, budget: &Budget) -> Action {
    // Envoy's TokenBucket needs tokens_per_fill > 0 (its proto validation),
    // and a bucket that holds nothing admits nothing.
    if s.max_tokens == 0 || s.tokens_per_fill == 0 {
        return Action::DenyAll;
    }
    Action::TokenBucket {
        max_tokens: u32::try_from(s.max_tokens).unwrap_or(u32::MAX),
        tokens_per_fill: u32::try_from(s.tokens_per_fill).unwrap_or(u32::MAX),
        fill_interval_secs: budget.fill_secs,
    }
}
