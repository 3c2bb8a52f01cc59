//! `check-config --diff`: what a config change does to each rule, before it
//! reaches the mesh.
//!
//! Both sides are reduced to a [`Rules`] map (rule path → [`RuleSummary`]),
//! from a compiled [`Config`] (files) or from a running replica's
//! `/rlconfig` JSON (read as [`crate::http::rlconfig::RlConfig`], the type
//! the endpoint writes), and compared rule by rule. A bucket's key is its domain
//! and entries, not its rate, so a rule that keeps its path keeps its
//! buckets across the change; what happens to them is spelled out per rule
//! (docs/design.md, "Reloads").

use super::{Config, Policy, Unit};
use crate::storage::AlgorithmKind;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The parts of a rule a diff compares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleSummary {
    /// `Some((requests_per_unit, unit, burst))` for a token bucket, `None`
    /// for `unlimited`.
    pub limit: Option<(u32, Unit, u32)>,
    /// `shadow_mode`.
    pub shadow_mode: bool,
    /// `quota_mode`.
    pub quota_mode: bool,
    /// The rule's `name` (reported to Envoy in `current_limit`).
    pub name: Option<String>,
    /// The debt bound in tokens: the rule's `max_debt` (a file), or the
    /// bound in force a replica's `/rlconfig` shows; 0 for none.
    pub max_debt: u32,
    /// The algorithm (token bucket for `unlimited`).
    pub algorithm: AlgorithmKind,
    /// `reservation` as `(ttl_seconds, max_open)`, when the rule has one.
    pub reservation: Option<(u32, u32)>,
}

/// Rules by path (`domain.key_value.key`), sorted.
pub type Rules = BTreeMap<String, RuleSummary>;

/// The service-wide settings that take part in what a replica's
/// `/rlconfig` shows per rule, as it states them (`modes`): a file's rules
/// are compared with a replica's under them, like for like.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InForce {
    /// `--max-debt-bursts`: a token bucket rule without a `max_debt` of
    /// its own (and not in quota mode) has a bound of this many bursts.
    pub max_debt_bursts: u32,
    /// `--quota-mode`: every rule in quota mode (no bound from
    /// `max_debt_bursts`).
    pub quota_mode: bool,
    /// `--default-algorithm`: the algorithm of a rule that names none. It
    /// takes part when a file is loaded
    /// ([`LoadOptions`](super::compile::LoadOptions)), not in
    /// [`rules_in_force`]. `None` from a replica older than
    /// `modes.default_algorithm`.
    pub default_algorithm: Option<AlgorithmKind>,
}

/// The rules of a compiled config, each with its own `max_debt` (none
/// from a service-wide setting).
#[must_use]
pub fn rules_of(config: &Config) -> Rules {
    rules_in_force(config, InForce::default())
}

/// The rules of a compiled config as a replica serving it under `in_force`
/// would show them: each `max_debt` is the bound in force (the rule's own,
/// else `max_debt_bursts` times its burst).
#[must_use]
pub fn rules_in_force(config: &Config, in_force: InForce) -> Rules {
    let settings = crate::settings::ServiceSettings {
        max_debt_bursts: in_force.max_debt_bursts,
        global_quota_mode: in_force.quota_mode,
        ..crate::settings::ServiceSettings::default()
    };
    let mut rules = Rules::new();
    for d in config.domains.values() {
        for r in &d.rules {
            // As `/rlconfig` computes it.
            let max_debt = r.limit(&settings).map_or(0, |l| l.max_debt());
            let (limit, algorithm) = match r.policy {
                Policy::Limited {
                    requests_per_unit,
                    unit,
                    burst,
                    algorithm,
                    ..
                } => (Some((requests_per_unit, unit, burst)), algorithm),
                Policy::Unlimited => (None, AlgorithmKind::TokenBucket),
            };
            rules.insert(
                r.path.clone(),
                RuleSummary {
                    limit,
                    shadow_mode: r.shadow_mode,
                    quota_mode: r.quota_mode,
                    name: r.name.clone(),
                    max_debt,
                    algorithm,
                    reservation: r.reservation.map(|x| (x.ttl_secs, x.max_open)),
                },
            );
        }
    }
    rules
}

/// The rules of a running replica, from its `GET /rlconfig` body, and the
/// service-wide settings their debt bounds include (to compare a file's
/// rules with them: [`rules_in_force`]).
///
/// # Errors
/// A message naming the rule path or the JSON error when the body is not the
/// `/rlconfig` shape.
pub fn rules_from_rlconfig(body: &[u8]) -> Result<(Rules, InForce), String> {
    let view: crate::http::rlconfig::RlConfig =
        serde_json::from_slice(body).map_err(|e| format!("not an /rlconfig answer: {e}"))?;
    let default_algorithm = match view.modes.default_algorithm.as_deref() {
        None => None,
        Some(a) => Some(
            AlgorithmKind::parse(a)
                .ok_or_else(|| format!("unknown modes.default_algorithm '{a}' in /rlconfig"))?,
        ),
    };
    let in_force = InForce {
        max_debt_bursts: view.modes.max_debt_bursts,
        quota_mode: view.modes.quota_mode,
        default_algorithm,
    };
    let mut rules = Rules::new();
    for r in view.domains.into_iter().flat_map(|d| d.rules) {
        let limit = if r.unlimited {
            None
        } else {
            let unit = r.unit.as_deref().unwrap_or_default();
            let unit = Unit::parse(unit)
                .ok_or_else(|| format!("{}: unknown unit '{unit}' in /rlconfig", r.path))?;
            match (r.requests_per_unit, r.burst) {
                (Some(rpu), Some(burst)) => Some((rpu, unit, burst)),
                _ => return Err(format!("{}: a limited rule without rate or burst", r.path)),
            }
        };
        // Replicas older than the field have token buckets only.
        let algorithm = match r.algorithm.as_deref() {
            None => AlgorithmKind::TokenBucket,
            Some(a) => AlgorithmKind::parse(a)
                .ok_or_else(|| format!("{}: unknown algorithm '{a}' in /rlconfig", r.path))?,
        };
        rules.insert(
            r.path,
            RuleSummary {
                limit,
                shadow_mode: r.shadow_mode,
                quota_mode: r.quota_mode,
                name: r.name,
                max_debt: r.max_debt.unwrap_or(0),
                algorithm,
                reservation: r.reservation.map(|x| (x.ttl_seconds, x.max_open)),
            },
        );
    }
    Ok((rules, in_force))
}

/// What a change does to a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ChangeKind {
    /// The rule is new: its buckets start full.
    Added,
    /// The rule is gone: its buckets are no longer charged.
    Removed,
    /// Neither the rate nor the burst went up, and one went down (or an
    /// unlimited rule became limited).
    Tightened,
    /// Neither went down and one went up (or the rule became unlimited).
    Loosened,
    /// The rate went one way and the burst the other.
    Mixed,
    /// Same limit; another setting (`shadow_mode`, `quota_mode`, `name`,
    /// `max_debt`, `algorithm`) changed.
    Changed,
}

impl ChangeKind {
    /// The word in the report.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Added => "added",
            Self::Removed => "removed",
            Self::Tightened => "tightened",
            Self::Loosened => "loosened",
            Self::Mixed => "tightened and loosened",
            Self::Changed => "changed",
        }
    }

    /// Whether the change can deny traffic that passes today (removing a
    /// rule cannot deny, but it drops a limit someone relied on, so it is
    /// reviewed like a tightening).
    #[must_use]
    pub const fn needs_review(self) -> bool {
        matches!(
            self,
            Self::Removed | Self::Tightened | Self::Mixed | Self::Changed
        )
    }
}

/// One rule's change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleChange {
    /// Rule path.
    pub path: String,
    /// What kind of change.
    pub kind: ChangeKind,
    /// The report line (`edge.per_ip: tightened: 10/second burst 20 -> ...`).
    pub line: String,
}

fn limit_text(r: &RuleSummary) -> String {
    match (r.limit, r.algorithm) {
        (Some((rpu, unit, burst)), AlgorithmKind::TokenBucket) => {
            format!("{rpu}/{} burst {burst}", unit.as_str())
        }
        (Some((rpu, unit, _)), a) => format!("{rpu}/{} {a}", unit.as_str()),
        (None, _) => "unlimited".to_owned(),
    }
}

/// What a new algorithm does to a rule's stored state: none of it is read
/// under another algorithm.
fn algorithm_effect(new: &RuleSummary) -> String {
    match (new.limit, new.algorithm) {
        (Some((_, _, burst)), AlgorithmKind::TokenBucket) => {
            format!("every bucket starts full ({burst} tokens)")
        }
        (Some(_), _) => "every window starts at zero".to_owned(),
        (None, _) => "no state is read".to_owned(),
    }
}

/// Tokens per second, as a fraction `rpu / secs`, compared exactly.
fn rate_cmp(a: (u32, Unit), b: (u32, Unit)) -> std::cmp::Ordering {
    (u128::from(a.0) * u128::from(b.1.secs())).cmp(&(u128::from(b.0) * u128::from(a.1.secs())))
}

fn flags_text(r: &RuleSummary) -> Vec<String> {
    let mut v = Vec::new();
    if r.shadow_mode {
        v.push("shadow_mode".to_owned());
    }
    if r.quota_mode {
        v.push("quota_mode".to_owned());
    }
    v
}

/// What the change does to buckets that exist.
fn bucket_effect(old: (u32, Unit, u32), new: (u32, Unit, u32)) -> String {
    let mut parts = Vec::new();
    match new.2.cmp(&old.2) {
        std::cmp::Ordering::Less => parts.push(format!(
            "existing buckets keep their tokens, capped at {}",
            new.2
        )),
        std::cmp::Ordering::Greater => parts.push(format!(
            "existing buckets keep their tokens and refill to {} (not at once)",
            new.2
        )),
        std::cmp::Ordering::Equal => parts.push("existing buckets keep their tokens".to_owned()),
    }
    if rate_cmp((new.0, new.1), (old.0, old.1)) != std::cmp::Ordering::Equal {
        parts.push(format!("refill at {}/{} from now", new.0, new.1.as_str()));
    }
    parts.join("; ")
}

/// What a change of rate or unit does to the windows of a window rule.
fn window_effect(old: (u32, Unit, u32), new: (u32, Unit, u32)) -> String {
    if old.1 == new.1 {
        format!(
            "existing windows keep their counts, now against {} per {}",
            new.0,
            new.1.as_str()
        )
    } else {
        format!("windows restart at zero, one per {}", new.1.as_str())
    }
}

/// Compares two rule sets. Changes are sorted by rule path.
#[must_use]
pub fn diff(old: &Rules, new: &Rules) -> Vec<RuleChange> {
    use std::cmp::Ordering::{Greater, Less};
    let mut changes = Vec::new();
    let paths: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for path in paths {
        let (kind, line) = match (old.get(path), new.get(path)) {
            (None, Some(n)) => (
                ChangeKind::Added,
                match n.limit {
                    Some((_, _, burst)) if !n.algorithm.is_window() => {
                        format!("{}: buckets start full ({burst} tokens)", limit_text(n))
                    }
                    Some(_) => format!("{}: windows start at zero", limit_text(n)),
                    None => "unlimited".to_owned(),
                },
            ),
            (Some(o), None) => (
                ChangeKind::Removed,
                format!("{}: its buckets are no longer charged", limit_text(o)),
            ),
            (Some(o), Some(n)) if o == n => continue,
            (Some(o), Some(n)) => {
                let limits = format!("{} -> {}", limit_text(o), limit_text(n));
                match (o.limit, n.limit) {
                    (Some(_), Some(_)) if o.algorithm != n.algorithm => (
                        // Rate and burst compare across algorithms, but what
                        // a client gets changes shape: always reviewed.
                        ChangeKind::Changed,
                        format!(
                            "{limits} (algorithm {} -> {}: {})",
                            o.algorithm,
                            n.algorithm,
                            algorithm_effect(n)
                        ),
                    ),
                    (Some(a), Some(b)) if a == b => (ChangeKind::Changed, limits),
                    (None, None) => (ChangeKind::Changed, limits),
                    (None, Some((_, _, burst))) => (
                        ChangeKind::Tightened,
                        if n.algorithm.is_window() {
                            format!("{limits}: windows start at zero")
                        } else {
                            format!("{limits}: buckets start full ({burst} tokens)")
                        },
                    ),
                    (Some(_), None) => (
                        ChangeKind::Loosened,
                        format!("{limits}: its buckets are no longer charged"),
                    ),
                    (Some(a), Some(b)) => {
                        let rate = rate_cmp((b.0, b.1), (a.0, a.1));
                        let burst = b.2.cmp(&a.2);
                        let down = rate == Less || burst == Less;
                        let up = rate == Greater || burst == Greater;
                        let kind = match (down, up) {
                            (true, false) => ChangeKind::Tightened,
                            (false, true) => ChangeKind::Loosened,
                            _ => ChangeKind::Mixed,
                        };
                        let effect = if n.algorithm.is_window() {
                            window_effect(a, b)
                        } else {
                            bucket_effect(a, b)
                        };
                        (kind, format!("{limits}: {effect}"))
                    }
                }
            }
            (None, None) => continue,
        };
        // A debt bound that changed makes any change one to review: it
        // decides whether denied requests are charged.
        let kind = match (old.get(path), new.get(path)) {
            (Some(o), Some(n))
                if (o.max_debt != n.max_debt || o.reservation != n.reservation)
                    && !kind.needs_review() =>
            {
                ChangeKind::Changed
            }
            _ => kind,
        };
        let mut line = format!("{path}: {}: {line}", kind.as_str());
        if let (Some(o), Some(n)) = (old.get(path), new.get(path)) {
            let (fo, fn_) = (flags_text(o), flags_text(n));
            if fo != fn_ {
                let show = |v: &[String]| {
                    if v.is_empty() {
                        "none".to_owned()
                    } else {
                        v.join(", ")
                    }
                };
                let _ = write!(line, " (modes {} -> {})", show(&fo), show(&fn_));
            }
            if o.max_debt != n.max_debt {
                let _ = write!(
                    line,
                    " (max_debt {} -> {}: {})",
                    o.max_debt,
                    n.max_debt,
                    debt_effect(o.max_debt, n.max_debt)
                );
            }
            if o.reservation != n.reservation {
                let show = |v: Option<(u32, u32)>| {
                    v.map_or_else(
                        || "none".to_owned(),
                        |(ttl, max_open)| format!("ttl {ttl} s, max_open {max_open}"),
                    )
                };
                let _ = write!(
                    line,
                    " (reservation {} -> {}{})",
                    show(o.reservation),
                    show(n.reservation),
                    if o.reservation.is_some() != n.reservation.is_some() {
                        ": the rule's buckets start full under their new key"
                    } else {
                        ""
                    }
                );
            }
            if o.name != n.name {
                let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_owned());
                let _ = write!(line, " (name {} -> {})", show(&o.name), show(&n.name));
            }
        } else if let Some(r) = new.get(path).or_else(|| old.get(path)) {
            let f = flags_text(r);
            if !f.is_empty() {
                let _ = write!(line, " ({})", f.join(", "));
            }
        }
        changes.push(RuleChange {
            path: path.clone(),
            kind,
            line,
        });
    }
    changes
}

/// What a change of the debt bound from `old` to `new` tokens does to the
/// buckets, in the model's terms: a charge is clamped at the bound and the
/// clamp never raises a balance, so a bucket already deeper than a lowered
/// bound keeps its debt and repays it by refill.
fn debt_effect(old: u32, new: u32) -> String {
    match (old, new) {
        (0, n) => format!("denied requests are charged from now on, down to -{n} tokens"),
        (_, 0) => "only admitted requests are charged from now on; a bucket in debt keeps it and repays it at the rule's rate".to_owned(),
        (o, n) if n > o => format!("charges may take a bucket down to -{n} tokens"),
        (_, n) => format!(
            "a bucket deeper than -{n} tokens keeps its debt and repays it at the rule's rate; no charge takes it deeper"
        ),
    }
}

/// The last line of a report: `3 rules changed: 1 added, 2 tightened`, or
/// `no rule changed`.
#[must_use]
pub fn summary(changes: &[RuleChange]) -> String {
    if changes.is_empty() {
        return "no rule changed".to_owned();
    }
    let mut counts: BTreeMap<ChangeKind, usize> = BTreeMap::new();
    for c in changes {
        *counts.entry(c.kind).or_default() += 1;
    }
    let parts: Vec<String> = counts
        .iter()
        .map(|(k, n)| format!("{n} {}", k.as_str()))
        .collect();
    format!(
        "{} rule{} changed: {}",
        changes.len(),
        if changes.len() == 1 { "" } else { "s" },
        parts.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(yaml: &str) -> Rules {
        let c = crate::config::compile::compile_texts(&[(
            "d.yaml".to_owned(),
            yaml.as_bytes().to_vec(),
        )])
        .expect("config loads");
        rules_of(&c)
    }

    const OLD: &str = "domain: edge
descriptors:
  - key: ip
    rate_limit: {unit: second, requests_per_unit: 10, burst: 20}
  - key: key
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: path
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: gone
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: shadow
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: mixed
    rate_limit: {unit: second, requests_per_unit: 10, burst: 10}
  - key: same
    rate_limit: {unit: day, requests_per_unit: 1}
";

    const NEW: &str = "domain: edge
descriptors:
  - key: ip
    rate_limit: {unit: second, requests_per_unit: 5, burst: 10}
  - key: key
    rate_limit: {unit: minute, requests_per_unit: 10, burst: 5}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: mixed
    rate_limit: {unit: second, requests_per_unit: 5, burst: 30}
  - key: same
    rate_limit: {unit: day, requests_per_unit: 1}
  - key: new
    rate_limit: {unit: hour, requests_per_unit: 100}
";

    #[test]
    fn diff_names_each_change_and_what_happens_to_existing_buckets() {
        let changes = diff(&rules(OLD), &rules(NEW));
        let lines: Vec<&str> = changes.iter().map(|c| c.line.as_str()).collect();
        assert_eq!(
            lines,
            [
                "edge.gone: removed: 1/second burst 1: its buckets are no longer charged",
                "edge.ip: tightened: 10/second burst 20 -> 5/second burst 10: existing buckets keep their tokens, capped at 10; refill at 5/second from now",
                "edge.key: loosened: 5/minute burst 5 -> 10/minute burst 5: existing buckets keep their tokens; refill at 10/minute from now",
                "edge.mixed: tightened and loosened: 10/second burst 10 -> 5/second burst 30: existing buckets keep their tokens and refill to 30 (not at once); refill at 5/second from now",
                "edge.new: added: 100/hour burst 100: buckets start full (100 tokens)",
                "edge.path: loosened: 2/hour burst 2 -> 2/minute burst 2: existing buckets keep their tokens; refill at 2/minute from now",
                "edge.shadow: changed: 1/second burst 1 -> 1/second burst 1 (modes none -> shadow_mode)",
            ]
        );
        assert_eq!(
            summary(&changes),
            "7 rules changed: 1 added, 1 removed, 1 tightened, 2 loosened, 1 tightened and loosened, 1 changed"
        );
        assert!(diff(&rules(OLD), &rules(OLD)).is_empty());
        assert_eq!(summary(&[]), "no rule changed");
    }

    /// Adding, changing or removing a `reservation` is a change to review,
    /// and says that the rule's buckets move to a new key.
    #[test]
    fn a_changed_reservation_is_a_change_to_review() {
        let yaml = |res: &str| {
            format!(
                "domain: d\ndescriptors:\n  - key: u\n    descriptors:\n      - key: id\n{res}        rate_limit: {{unit: hour, requests_per_unit: 10}}\n"
            )
        };
        let plain = rules(&yaml(""));
        let short = rules(&yaml("        reservation: {ttl_seconds: 60}\n"));
        let long = rules(&yaml(
            "        reservation: {ttl_seconds: 600, max_open: 5}\n",
        ));
        let c = diff(&plain, &short);
        assert_eq!(c[0].kind, ChangeKind::Changed);
        assert_eq!(
            c[0].line,
            "d.u.id: changed: 10/hour burst 10 -> 10/hour burst 10 (reservation none -> ttl 60 s, max_open 1000: the rule's buckets start full under their new key)"
        );
        assert_eq!(
            diff(&short, &long)[0].line,
            "d.u.id: changed: 10/hour burst 10 -> 10/hour burst 10 (reservation ttl 60 s, max_open 1000 -> ttl 600 s, max_open 5)"
        );
    }

    #[test]
    fn a_changed_debt_bound_is_a_change_to_review() {
        let a = rules(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
        );
        let b = rules(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10, max_debt: 100}\n",
        );
        let c = diff(&a, &b);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].kind, ChangeKind::Changed);
        assert_eq!(
            c[0].line,
            "d.k: changed: 10/minute burst 10 -> 10/minute burst 10 (max_debt 0 -> 100: denied requests are charged from now on, down to -100 tokens)"
        );
        // Lowered: what happens to buckets deeper than the new bound.
        let shallow = rules(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10, max_debt: 20}\n",
        );
        assert_eq!(
            diff(&b, &shallow)[0].line,
            "d.k: changed: 10/minute burst 10 -> 10/minute burst 10 (max_debt 100 -> 20: a bucket deeper than -20 tokens keeps its debt and repays it at the rule's rate; no charge takes it deeper)"
        );
        assert_eq!(
            diff(&shallow, &b)[0].line,
            "d.k: changed: 10/minute burst 10 -> 10/minute burst 10 (max_debt 20 -> 100: charges may take a bucket down to -100 tokens)"
        );
        assert!(
            diff(&b, &a)[0]
                .line
                .ends_with("(max_debt 100 -> 0: only admitted requests are charged from now on; a bucket in debt keeps it and repays it at the rule's rate)")
        );
        let faster = rules(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 20, max_debt: 100}\n",
        );
        assert!(
            diff(&a, &faster)[0].kind.needs_review(),
            "loosened, with a new debt bound"
        );
    }

    #[test]
    fn unlimited_to_limited_is_a_tightening_and_back_a_loosening() {
        let u = rules("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true}\n");
        let l = rules(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 3}\n",
        );
        let to = diff(&u, &l);
        assert_eq!(to[0].kind, ChangeKind::Tightened);
        assert_eq!(
            to[0].line,
            "d.k: tightened: unlimited -> 3/second burst 3: buckets start full (3 tokens)"
        );
        let back = diff(&l, &u);
        assert_eq!(back[0].kind, ChangeKind::Loosened);
        assert!(!back[0].kind.needs_review());
    }

    /// Under `--max-debt-bursts`, a token bucket rule without its own
    /// `max_debt` has a bound of that many bursts; a rule's own bound, a
    /// quota mode rule (its own or `--quota-mode`), a window and a rate of
    /// 0 are left as they are.
    #[test]
    fn rules_in_force_apply_max_debt_bursts_as_a_replica_does() {
        let c = crate::config::compile::compile_texts(&[(
            "t.yaml".into(),
            b"domain: d\ndescriptors:\n  - key: plain\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 20}\n  - key: own\n    rate_limit: {unit: second, requests_per_unit: 10, max_debt: 7}\n  - key: quota\n    quota_mode: true\n    rate_limit: {unit: second, requests_per_unit: 10}\n  - key: win\n    rate_limit: {unit: second, requests_per_unit: 10, algorithm: fixed_window}\n  - key: zero\n    rate_limit: {unit: second, requests_per_unit: 0}\n".to_vec(),
        )])
        .expect("loads");
        let debts = |in_force| {
            rules_in_force(&c, in_force)
                .into_iter()
                .map(|(p, r)| (p, r.max_debt))
                .collect::<Vec<_>>()
        };
        let named = |v: [u32; 5]| {
            ["d.own", "d.plain", "d.quota", "d.win", "d.zero"]
                .into_iter()
                .map(str::to_owned)
                .zip(v)
                .collect::<Vec<_>>()
        };
        assert_eq!(debts(InForce::default()), named([7, 0, 0, 0, 0]));
        assert_eq!(rules_of(&c), rules_in_force(&c, InForce::default()));
        let bursts = InForce {
            max_debt_bursts: 2,
            ..InForce::default()
        };
        assert_eq!(debts(bursts), named([7, 40, 0, 0, 0]));
        let global_quota = InForce {
            quota_mode: true,
            ..bursts
        };
        assert_eq!(debts(global_quota), named([7, 0, 0, 0, 0]));
    }

    #[test]
    fn rlconfig_json_reads_back_as_the_same_rules() {
        let body = serde_json::json!({
            "hash": "x",
            "domains": [{"domain": "edge", "file": "d.yaml", "rules": [
                {"path": "edge.ip", "name": null, "unlimited": false, "requests_per_unit": 10,
                 "unit": "second", "burst": 20, "shadow_mode": false, "quota_mode": false},
                {"path": "edge.free", "unlimited": true, "shadow_mode": false}
            ]}]
        });
        let (r, in_force) = rules_from_rlconfig(body.to_string().as_bytes()).expect("parses");
        assert_eq!(r["edge.ip"].limit, Some((10, Unit::Second, 20)));
        assert_eq!(r["edge.free"].limit, None);
        // An answer without `modes.max_debt_bursts` or
        // `modes.default_algorithm` (older replicas): none, and not known.
        assert_eq!(in_force, InForce::default());
        let with_modes = serde_json::json!({
            "modes": {"shadow_mode": false, "quota_mode": true, "max_debt_bursts": 3,
                      "default_algorithm": "sliding_window"},
            "domains": []
        });
        let (_, in_force) = rules_from_rlconfig(with_modes.to_string().as_bytes()).expect("parses");
        assert_eq!(
            in_force,
            InForce {
                max_debt_bursts: 3,
                quota_mode: true,
                default_algorithm: Some(AlgorithmKind::SlidingWindow),
            }
        );
        let unknown = serde_json::json!({"modes": {"default_algorithm": "leaky"}, "domains": []});
        let e = rules_from_rlconfig(unknown.to_string().as_bytes()).unwrap_err();
        assert!(e.contains("default_algorithm 'leaky'"), "{e}");
        let bad = serde_json::json!({"domains": [{"rules": [
            {"path": "edge.ip", "unlimited": false, "unit": "fortnight", "requests_per_unit": 1, "burst": 1}]}]});
        let e = rules_from_rlconfig(bad.to_string().as_bytes()).unwrap_err();
        assert_eq!(e, "edge.ip: unknown unit 'fortnight' in /rlconfig");
        assert!(
            rules_from_rlconfig(b"<html>")
                .unwrap_err()
                .starts_with("not an /rlconfig answer")
        );
    }
}
