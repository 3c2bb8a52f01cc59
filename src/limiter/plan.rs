//! Planning: which rule answers each descriptor (matching, `replaces`,
//! overrides) and which bucket charges go to storage, before storage is
//! called.

use super::labels::ValueLabels;
use super::request::Request;
use super::verdict::CurrentLimit;
use crate::config::{DomainConfig, Metadata, MetricLevel, MetricLevelKind, Policy, Rule};
use crate::matcher;
use crate::metrics::RuleCounters;
use crate::settings::ServiceSettings;
use crate::storage::algorithm::reservation::{MAX_RESERVATION_ID_BYTES, ReservationId, Reserve};
use crate::storage::key::{self, KeyValue};
use crate::storage::{
    AlgorithmKind, BucketLimit, Charge, ChargeKind, ChargeSpec, Limit, WindowLimit,
};
use std::collections::HashSet;
use std::sync::Arc;

/// How one descriptor is answered, decided before storage is called.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Plan {
    /// No rule, replaced, empty descriptor or unknown domain.
    NoLimit,
    /// `unlimited: true`.
    Unlimited,
    /// A bucket to charge.
    Limited {
        /// Index into the charges sent to storage.
        charge: usize,
        /// The counters of the rule's metric label.
        counters: Arc<RuleCounters>,
        /// The limit reported back.
        current: CurrentLimit,
        /// Tokens this descriptor takes (or gives back).
        cost: u64,
        /// The rule's shadow mode: never denies, answered `OK`.
        shadow: bool,
        /// Quota mode (the rule's or the service's): over the limit, it denies
        /// only together with every other quota descriptor of the request.
        quota: bool,
        /// The rule's `metadata`, for the response's dynamic metadata.
        metadata: Option<Arc<Metadata>>,
        /// Index of the matched rule in the domain (none for an override
        /// without a rule), for the debug explanation.
        rule: Option<usize>,
    },
}

/// Plans every descriptor of `req` against `domain`: one [`Plan`] per
/// descriptor and the charges for storage, in descriptor order. Bucket keys
/// start with the settings' key prefix; metric labels that carry request
/// values are bounded by `labels`.
pub(super) fn plan(
    domain: &DomainConfig,
    req: &Request<'_>,
    settings: &ServiceSettings,
    labels: &ValueLabels,
) -> (Vec<Plan>, Vec<Charge>) {
    // Pass 1: match every descriptor and collect `replaces`. A descriptor
    // longer than `max_entries` is deeper than any rule can be (a config
    // nests about 30 levels before its parser's depth bound), so it is not
    // looked up at all: answered OK without a limit, with no work that
    // grows with its length (docs/design.md, "Matching descriptors").
    let too_long = |d: &super::request::Descriptor<'_>| d.entries.len() > settings.max_entries;
    // A descriptor ending with the settlement marker whose other entries
    // match a reservation rule is that reservation's settlement
    // (docs/design.md, "Reservations"); it needs no rule of its own.
    let settles: Vec<bool> = req
        .descriptors
        .iter()
        .map(|d| !too_long(d) && settlement_of(domain, &d.entries).is_some())
        .collect();
    let matched: Vec<Option<matcher::Matched<'_>>> = req
        .descriptors
        .iter()
        .zip(&settles)
        .map(|(d, &settle)| {
            if too_long(d) {
                None
            } else if settle {
                settlement_of(domain, &d.entries)
            } else {
                matcher::find(&domain.root, &d.entries)
            }
        })
        .collect();
    // As in the Go service, a descriptor with a `limit` override is not
    // answered by its rule: it neither replaces nor is replaced.
    let replaced: HashSet<&str> = req
        .descriptors
        .iter()
        .zip(&matched)
        .filter(|(d, _)| d.limit.is_none())
        .filter_map(|(_, m)| m.as_ref())
        .flat_map(|m| domain.rules[m.rule].replaces.iter().map(String::as_str))
        .collect();
    // Pass 2: build charges.
    let mut plans = Vec::with_capacity(req.descriptors.len());
    let mut charges = Vec::new();
    for ((d, mt), &settle) in req.descriptors.iter().zip(&matched).zip(&settles) {
        if too_long(d) {
            plans.push(Plan::NoLimit);
            continue;
        }
        let cost = d.cost(req.hits_addend);
        let rule = mt.as_ref().map(|m| &domain.rules[m.rule]);
        // The reservation of a reservation rule's descriptor: its last
        // entry (the settlement's last but one) is the id, the entries above
        // it key the bucket, whatever the call: with a `limit` override
        // (the override's bucket of the entries above, never one per id)
        // and with `is_negative_hits` (a refund to that bucket).
        let reserving = match rule.and_then(|r| r.reservation) {
            Some(res) => {
                let id_at = if settle {
                    d.entries.len() - 2
                } else {
                    d.entries.len() - 1
                };
                let id = ReservationId::of_bytes(clip_id(d.entries[id_at].1));
                let kind = if d.is_negative_hits {
                    ChargeKind::Refund
                } else if settle {
                    ChargeKind::Settle { id }
                } else if cost == 0 {
                    // A check (a `hits_addend` of 0, the way to read a
                    // balance) reserves nothing: it reads the user's
                    // bucket and opens no reservation, so reads cannot
                    // fill `max_open`.
                    ChargeKind::Consume
                } else {
                    ChargeKind::Reserve(Reserve {
                        id,
                        ttl_secs: res.ttl_secs,
                        max_open: res.max_open,
                    })
                };
                Some((id_at, kind))
            }
            _ => None,
        };
        let kind = match reserving {
            Some((_, kind)) => kind,
            None if d.is_negative_hits => ChargeKind::Refund,
            None => ChargeKind::Consume,
        };
        if let Some(r) = rule
            && d.limit.is_none()
            && r.name.as_deref().is_some_and(|n| replaced.contains(n))
        {
            plans.push(Plan::NoLimit);
            continue;
        }
        let (limit, current, shadow, quota, metadata, own_bucket) = match (rule, &d.limit) {
            (None, Some(_)) if settings.ignore_unmatched_overrides => {
                plans.push(Plan::NoLimit);
                continue;
            }
            (_, Some(o)) if !d.entries.is_empty() => {
                // Validation refuses unknown units before planning.
                let Ok(unit) = o.unit else {
                    plans.push(Plan::NoLimit);
                    continue;
                };
                // An override carries no algorithm: it gets the service's
                // default, whatever the rule it lands on uses.
                let limit = match settings.default_algorithm {
                    AlgorithmKind::TokenBucket => Limit::TokenBucket(BucketLimit {
                        requests_per_unit: o.requests_per_unit,
                        unit_secs: unit.secs_nonzero(),
                        burst: o.requests_per_unit,
                        // An override's burst is its rate; only the
                        // service-wide debt bound applies (a rule's
                        // `max_debt` is in the rule's tokens).
                        max_debt: if o.requests_per_unit == 0 {
                            0
                        } else {
                            o.requests_per_unit.saturating_mul(settings.max_debt_bursts)
                        },
                    }),
                    AlgorithmKind::FixedWindow => Limit::FixedWindow(WindowLimit::counting(
                        o.requests_per_unit,
                        unit.secs_nonzero(),
                    )),
                    AlgorithmKind::SlidingWindow => Limit::SlidingWindow(WindowLimit {
                        requests_per_unit: o.requests_per_unit,
                        unit_secs: unit.secs_nonzero(),
                        counts_denied: false,
                    }),
                };
                // As in the Go service (`GetLimit` builds the override's
                // limit before looking at the rules): no name, no shadow
                // mode (an override Envoy sends must be enforced), no quota
                // mode, no metadata; `replaces` skips it (pass 1).
                let current = CurrentLimit {
                    name: String::new(),
                    requests_per_unit: o.requests_per_unit,
                    unit,
                };
                // Its own bucket per rate: a bucket refills only at its own
                // rate, never at an override's (docs/design.md, "Overrides").
                let own = Some((o.requests_per_unit, unit.secs()));
                (limit, current, false, false, None, own)
            }
            (Some(r), None) => match (r.limit(settings), &r.policy) {
                (
                    Some(limit),
                    Policy::Limited {
                        requests_per_unit,
                        unit,
                        ..
                    },
                ) => (
                    limit,
                    CurrentLimit {
                        name: r.name.clone().unwrap_or_default(),
                        requests_per_unit: *requests_per_unit,
                        unit: *unit,
                    },
                    r.shadow_mode,
                    r.quota_mode,
                    r.metadata.clone(),
                    None,
                ),
                _ => {
                    plans.push(Plan::Unlimited);
                    continue;
                }
            },
            _ => {
                plans.push(Plan::NoLimit);
                continue;
            }
        };
        let shared = mt.as_ref().map(|m| m.shared.as_slice()).unwrap_or(&[]);
        let mut entries: Vec<(&str, KeyValue<'_>)> = d
            .entries
            .iter()
            .enumerate()
            .map(|(i, &(k, v))| {
                (
                    k,
                    shared
                        .get(i)
                        .copied()
                        .flatten()
                        .map_or(KeyValue::Value(v), KeyValue::Shared),
                )
            })
            .collect();
        if let Some((id_at, _)) = reserving {
            // Every reservation of the entries above the id charges one
            // bucket: the id entry's key stays (the bucket is apart from a
            // rule on the entries above), with no value.
            entries.truncate(id_at + 1);
            entries[id_at].1 = KeyValue::Shared(key::RESERVATION_VALUE);
        }
        let counters = match rule {
            Some(r) => rule_counters(r, &domain.name, &d.entries, labels),
            None => domain.override_counters.clone(),
        };
        // A debt rule is never a quota: its charge is taken anyway, so it
        // must deny on its own (docs/design.md, "Debt").
        let quota = (quota || settings.global_quota_mode) && !limit.charges_when_denied();
        plans.push(Plan::Limited {
            charge: charges.len(),
            counters,
            current,
            cost,
            shadow,
            quota,
            metadata,
            rule: mt.as_ref().map(|m| m.rule),
        });
        // Reservations live beside token buckets only: under an override
        // that gets a window (`--default-algorithm`), a reserve is a plain
        // consume and a settlement charges its cost in full.
        let kind = match kind {
            ChargeKind::Reserve(_) | ChargeKind::Settle { .. }
                if !matches!(limit, Limit::TokenBucket(_)) =>
            {
                ChargeKind::Consume
            }
            k => k,
        };
        let mut bucket_key = key::encode(&settings.key_prefix, &domain.name, &entries);
        if let Some((rpu, unit_secs)) = own_bucket {
            key::push_override_rate(&mut bucket_key, rpu, unit_secs);
        }
        charges.push(Charge {
            key: bucket_key,
            spec: ChargeSpec {
                limit,
                cost,
                kind,
                // Under the service-wide shadow mode no charge blocks
                // admission in storage.
                shadow: shadow || settings.global_shadow_mode,
            },
        });
    }
    (plans, charges)
}

/// The last entry of a settlement descriptor: `phase` = `settle`, added by
/// the response-end `rate_limits` entry (a `generic_key` with
/// `descriptor_key: phase`), so the settlement is told from the reserve by
/// what Envoy sends, never by whether a reservation is open.
pub const SETTLE_ENTRY: (&str, &str) = ("phase", "settle");

/// The match of a settlement: `entries` end with [`SETTLE_ENTRY`] and the
/// others match a rule with a `reservation`.
fn settlement_of<'a>(
    domain: &'a DomainConfig,
    entries: &[(&str, &str)],
) -> Option<matcher::Matched<'a>> {
    let (last, rest) = entries.split_last()?;
    if *last != SETTLE_ENTRY || rest.is_empty() {
        return None;
    }
    matcher::find(&domain.root, rest).filter(|m| domain.rules[m.rule].reservation.is_some())
}

/// A reservation id as the service reads it: its first
/// [`MAX_RESERVATION_ID_BYTES`] bytes (ids longer than that which share
/// them share a reservation; a client only collides with itself, as the
/// bucket is its own).
fn clip_id(id: &str) -> &[u8] {
    let b = id.as_bytes();
    &b[..b.len().min(MAX_RESERVATION_ID_BYTES)]
}

/// The counters of `rule`'s metric label for a descriptor of `entries`: the
/// rule's path, or with `detailed_metric` or `value_to_metric` a label that
/// carries the request's values, bounded by `labels`.
fn rule_counters(
    rule: &Rule,
    domain: &str,
    entries: &[(&str, &str)],
    labels: &ValueLabels,
) -> Arc<RuleCounters> {
    if rule.detailed_metric {
        labels.bounded(&rule.path, detailed_label(domain, entries))
    } else if let Some(levels) = &rule.metric_levels {
        labels.bounded(&rule.path, value_label(domain, levels, entries))
    } else {
        rule.counters.clone()
    }
}

/// `domain.key_value.key2_value2`: the metric label of a `detailed_metric` rule.
fn detailed_label(domain: &str, entries: &[(&str, &str)]) -> String {
    let mut s = domain.to_owned();
    for (k, v) in entries {
        s.push('.');
        s.push_str(k);
        s.push('_');
        s.push_str(&ValueLabels::clip(v));
    }
    s
}

/// The label of a rule with `value_to_metric` on some level of its path
/// (the Go service's rule): an exact level carries its value; a key-only
/// level carries the request's value with `value_to_metric`, else only the
/// key; a wildcard level carries the request's value with `value_to_metric`
/// (unless `share_threshold`), else the pattern.
fn value_label(domain: &str, levels: &[MetricLevel], entries: &[(&str, &str)]) -> String {
    let mut s = domain.to_owned();
    for (level, (k, v)) in levels.iter().zip(entries) {
        s.push('.');
        s.push_str(k);
        let shown = match &level.kind {
            MetricLevelKind::Exact(value) => Some(value.as_str()),
            MetricLevelKind::KeyOnly => level.value_to_metric.then_some(*v),
            MetricLevelKind::Wildcard {
                pattern,
                share_threshold,
            } => Some(if level.value_to_metric && !share_threshold {
                *v
            } else {
                pattern.as_str()
            }),
        };
        if let Some(shown) = shown.filter(|x| !x.is_empty()) {
            s.push('_');
            s.push_str(&ValueLabels::clip(shown));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Unit;
    use crate::config::compile::compile_texts;
    use crate::limiter::request::{Descriptor, Override};

    fn domain(yaml: &str) -> std::sync::Arc<DomainConfig> {
        let config = compile_texts(&[("t.yaml".into(), yaml.as_bytes().to_vec())]).unwrap();
        config.domains["d"].clone()
    }

    const YAML: &str = "domain: d
descriptors:
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 5, name: per_ip}
  - key: vip
    rate_limit: {unlimited: true}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 2, name: per_user, replaces: [{name: per_ip}]}
";

    fn settings() -> ServiceSettings {
        ServiceSettings {
            key_prefix: "p:".into(),
            ..ServiceSettings::default()
        }
    }

    fn req<'a>(descriptors: Vec<Descriptor<'a>>) -> Request<'a> {
        Request {
            domain: "d",
            descriptors,
            hits_addend: 3,
        }
    }

    #[test]
    fn plans_follow_rules_and_costs() {
        let d = domain(YAML);
        let r = req(vec![
            Descriptor::new(vec![("ip", "1.2.3.4")]),
            Descriptor::new(vec![("vip", "x")]),
            Descriptor::new(vec![("nope", "x")]),
        ]);
        let (plans, charges) = plan(&d, &r, &settings(), &ValueLabels::default());
        assert_eq!(charges.len(), 1);
        assert!(charges[0].key.starts_with("p:"));
        assert_eq!(charges[0].spec.cost, 3);
        let bucket = bucket_of(&charges[0]);
        assert_eq!(bucket.unit_secs.get(), 60);
        assert_eq!(bucket.burst, 5);
        assert!(matches!(
            &plans[0],
            Plan::Limited { charge: 0, cost: 3, current, .. }
                if current.name == "per_ip" && current.unit == Unit::Minute
        ));
        assert_eq!(plans[1], Plan::Unlimited);
        assert_eq!(plans[2], Plan::NoLimit);
    }

    /// The token bucket limit of a charge.
    fn bucket_of(c: &Charge) -> crate::storage::BucketLimit {
        *c.spec.limit.token_bucket().expect("a token bucket")
    }

    #[test]
    fn a_replaced_rule_charges_nothing() {
        let d = domain(YAML);
        let r = req(vec![
            Descriptor::new(vec![("ip", "1.2.3.4")]),
            Descriptor::new(vec![("user", "u")]),
        ]);
        let (plans, charges) = plan(&d, &r, &settings(), &ValueLabels::default());
        assert_eq!(plans[0], Plan::NoLimit);
        assert_eq!(charges.len(), 1);
        assert_eq!(bucket_of(&charges[0]).requests_per_unit, 2);
    }

    #[test]
    fn an_override_sets_rate_and_capacity_without_the_rules_name() {
        let d = domain(YAML);
        let mut o = Descriptor::new(vec![("ip", "1.2.3.4")]);
        o.limit = Some(Override {
            requests_per_unit: 100,
            unit: Ok(Unit::Hour),
        });
        o.is_negative_hits = true;
        o.hits_addend = Some(0);
        let (plans, charges) = plan(&d, &req(vec![o]), &settings(), &ValueLabels::default());
        let spec = charges[0].spec;
        let bucket = bucket_of(&charges[0]);
        assert_eq!(
            (
                bucket.requests_per_unit,
                bucket.unit_secs.get(),
                bucket.burst
            ),
            (100, 3600, 100)
        );
        assert_eq!(spec.kind, ChargeKind::Refund);
        assert_eq!(spec.cost, 0);
        assert!(matches!(&plans[0], Plan::Limited { current, .. } if current.name.is_empty()));
    }

    /// As in the Go service, an override is built without the rule: its
    /// shadow mode does not apply, and `replaces` neither drops it nor
    /// comes from it.
    #[test]
    fn an_override_is_enforced_on_a_shadow_rule_and_outside_replaces() {
        let d = domain(
            "domain: d
descriptors:
  - key: ip
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 5, name: per_ip}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 2, name: per_user, replaces: [{name: per_ip}]}
",
        );
        let with = |entries| {
            let mut o = Descriptor::new(entries);
            o.limit = Some(Override {
                requests_per_unit: 7,
                unit: Ok(Unit::Minute),
            });
            o
        };
        let limited = |p: &Plan| match p {
            Plan::Limited {
                shadow, current, ..
            } => Some((*shadow, current.requests_per_unit)),
            _ => None,
        };
        // The shadow rule's override: enforced, with the override's rate,
        // and not replaced by `per_user`.
        let r = req(vec![
            with(vec![("ip", "1.2.3.4")]),
            Descriptor::new(vec![("user", "u")]),
        ]);
        let (plans, charges) = plan(&d, &r, &settings(), &ValueLabels::default());
        assert_eq!(limited(&plans[0]), Some((false, 7)));
        assert!(!charges[0].spec.shadow);
        // An override on the replacing rule replaces nothing: `per_ip` is
        // evaluated (in its own shadow mode).
        let r = req(vec![
            Descriptor::new(vec![("ip", "1.2.3.4")]),
            with(vec![("user", "u")]),
        ]);
        let (plans, _) = plan(&d, &r, &settings(), &ValueLabels::default());
        assert_eq!(limited(&plans[0]), Some((true, 5)));
        assert_eq!(limited(&plans[1]), Some((false, 7)));
        // Without overrides `replaces` applies as before.
        let r = req(vec![
            Descriptor::new(vec![("ip", "1.2.3.4")]),
            Descriptor::new(vec![("user", "u")]),
        ]);
        let (plans, _) = plan(&d, &r, &settings(), &ValueLabels::default());
        assert_eq!(plans[0], Plan::NoLimit);
    }

    #[test]
    fn detailed_labels_carry_the_request_values() {
        assert_eq!(detailed_label("d", &[("a", "1"), ("b", "2")]), "d.a_1.b_2");
    }
}
