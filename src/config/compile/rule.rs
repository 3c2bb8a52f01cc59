//! The blocks of one descriptor that make its rule: `rate_limit` (the
//! policy and its name), `replaces` and `reservation`, each validated with
//! every problem collected in the file's `Ctx`.

use super::{Ctx, RATE_LIMIT_KEYS, RESERVATION_KEYS};
use crate::config::schema::{RawRateLimit, RawReplace, RawReservation};
use crate::config::{Policy, ReservationRule, Unit};
use crate::storage::algorithm::AlgorithmKind;

/// A descriptor's `reservation:` block at `path`: `ttl_seconds` (1 ..
/// [`MAX_TTL_SECS`](crate::storage::algorithm::reservation::MAX_TTL_SECS),
/// required) and `max_open` (1 .. `MAX_MAX_OPEN`, default
/// `DEFAULT_MAX_OPEN`). The entry must be key-only (every request's id is
/// a new value) and end its path (its settlement is its path plus the
/// phase entry).
pub(super) fn compile_reservation(
    cx: &mut Ctx<'_>,
    r: &RawReservation,
    path: &str,
    has_value: bool,
    has_children: bool,
) -> Option<ReservationRule> {
    use crate::storage::algorithm::reservation::{DEFAULT_MAX_OPEN, MAX_MAX_OPEN, MAX_TTL_SECS};
    let errors_before = cx.errors.len();
    cx.stray(&r.stray, path, RESERVATION_KEYS);
    if has_value {
        cx.err(
            r.line,
            path,
            "a reservation entry must be key-only (no 'value'): it carries each request's own id, such as x-request-id",
        );
    }
    if has_children {
        cx.err(
            r.line,
            path,
            "a reservation entry must end its path (no 'descriptors' below it): its settlement is this path plus the entry phase=settle",
        );
    }
    let ttl = match &r.ttl_seconds {
        None => {
            cx.err(
                r.line,
                path,
                "missing 'ttl_seconds' (how long an unsettled reservation is kept: longer than the longest response)",
            );
            None
        }
        Some(t) => cx.uint(t, path, "ttl_seconds").and_then(|v| {
            if v == 0 || v > MAX_TTL_SECS {
                cx.err(
                    t.line,
                    path,
                    format!("ttl_seconds must be between 1 and {MAX_TTL_SECS} (one week), got {v}"),
                );
                None
            } else {
                Some(v)
            }
        }),
    };
    let max_open = match &r.max_open {
        None => Some(DEFAULT_MAX_OPEN),
        Some(t) => cx.uint(t, path, "max_open").and_then(|v| {
            if v == 0 || v > MAX_MAX_OPEN {
                cx.err(
                    t.line,
                    path,
                    format!("max_open must be between 1 and {MAX_MAX_OPEN}, got {v}"),
                );
                None
            } else {
                Some(v)
            }
        }),
    };
    match (ttl, max_open) {
        (Some(ttl_secs), Some(max_open)) if cx.errors.len() == errors_before => {
            Some(ReservationRule { ttl_secs, max_open })
        }
        _ => None,
    }
}

pub(super) fn compile_replaces(cx: &mut Ctx<'_>, list: &[RawReplace], path: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, r) in list.iter().enumerate() {
        let here = format!("{path}[{i}]");
        cx.stray(&r.stray, &here, &["name"]);
        cx.text(r.name.as_ref(), &here, "name");
        match &r.name {
            Some(n) if !n.value.trim().is_empty() => out.push(n.value.clone()),
            _ => cx.err(r.line, &here, "replaces entry needs a non-empty 'name'"),
        }
    }
    out
}

pub(super) fn compile_rate_limit(
    cx: &mut Ctx<'_>,
    rl: &RawRateLimit,
    path: &str,
) -> Option<(Policy, Option<String>)> {
    let errors_before = cx.errors.len();
    cx.stray(&rl.stray, path, RATE_LIMIT_KEYS);
    cx.text(rl.name.as_ref(), path, "name");
    let name = match &rl.name {
        Some(n) if n.value.trim().is_empty() => {
            cx.err(n.line, path, "name must not be empty");
            None
        }
        Some(n) => Some(n.value.clone()),
        None => None,
    };
    let unlimited = cx.boolean(rl.unlimited.as_ref(), path, "unlimited");
    if unlimited {
        for (field, given) in [
            ("unit", rl.unit.is_some()),
            ("burst", rl.burst.is_some()),
            ("max_debt", rl.max_debt.is_some()),
            ("algorithm", rl.algorithm.is_some()),
        ] {
            if given {
                cx.err(
                    rl.line,
                    path,
                    format!("'{field}' must not be given with 'unlimited: true'"),
                );
            }
        }
        // The Go service accepts (and ignores) a rate beside `unlimited`;
        // it must still be a number.
        if let Some(t) = &rl.requests_per_unit {
            let _ = cx.uint(t, path, "requests_per_unit");
        }
        return (cx.errors.len() == errors_before).then_some((Policy::Unlimited, name));
    }
    // With a misspelt key in the block, "missing" errors would only be noise.
    let report_missing = rl.stray.is_empty();
    let algorithm = match &rl.algorithm {
        None => Some(cx.default_algorithm),
        Some(a) => {
            let parsed = AlgorithmKind::parse(a.value.trim());
            if parsed.is_none() {
                let names: Vec<&str> = AlgorithmKind::ALL.iter().map(|k| k.as_str()).collect();
                cx.err(
                    a.line,
                    path,
                    format!("bad algorithm '{}': expected {}", a.value, names.join(", ")),
                );
            }
            parsed
        }
    };
    // A window counts requests per window: it has no capacity of its own
    // and no debt (docs/design.md, "Windows").
    if let Some(kind) = algorithm.filter(|k| k.is_window()) {
        let why = if rl.algorithm.is_some() {
            format!("'algorithm: {kind}'")
        } else {
            format!(
                "the default algorithm {kind} (--default-algorithm); add 'algorithm: token_bucket' for a bucket"
            )
        };
        for (field, t) in [("burst", &rl.burst), ("max_debt", &rl.max_debt)] {
            if let Some(t) = t {
                cx.err(
                    t.line,
                    path,
                    format!("'{field}' is a token bucket setting: this rule is a window, by {why}"),
                );
            }
        }
    }
    let unit = match &rl.unit {
        None => {
            if report_missing {
                cx.err(
                    rl.line,
                    path,
                    "missing 'unit' (second, minute, hour, day, week, month or year)",
                );
            }
            None
        }
        Some(u) => {
            let parsed = Unit::parse(u.value.trim());
            if parsed.is_none() {
                cx.err(
                    u.line,
                    path,
                    format!(
                        "bad unit '{}': expected second, minute, hour, day, week, month or year",
                        u.value
                    ),
                );
            }
            parsed
        }
    };
    let rpu = match &rl.requests_per_unit {
        None => {
            if report_missing {
                cx.err(rl.line, path, "missing 'requests_per_unit'");
            }
            None
        }
        Some(t) => cx.uint(t, path, "requests_per_unit"),
    };
    let burst = match &rl.burst {
        None => rpu,
        Some(t) => {
            let b = cx.uint(t, path, "burst");
            if b == Some(0) && rpu.is_some_and(|r| r > 0) {
                cx.err(t.line, path, "burst must be at least 1 when requests_per_unit > 0 (a bucket of capacity 0 admits nothing)");
            }
            b
        }
    };
    // Tokens the balance may go below zero (charges after the response,
    // docs/design.md, "Debt"); a rule that never refills could never repay.
    let max_debt = match &rl.max_debt {
        None => Some(None),
        Some(t) => {
            let d = cx.uint(t, path, "max_debt");
            if d.is_some_and(|d| d > 0) && rpu == Some(0) {
                cx.err(
                    t.line,
                    path,
                    "max_debt must be 0 when requests_per_unit is 0 (a bucket that never refills never repays a debt)",
                );
            }
            d.map(Some)
        }
    };
    match (unit, rpu, burst, max_debt, algorithm) {
        (Some(unit), Some(requests_per_unit), Some(burst), Some(max_debt), Some(algorithm))
            if cx.errors.len() == errors_before =>
        {
            let burst = if requests_per_unit == 0 { 0 } else { burst };
            Some((
                Policy::Limited {
                    requests_per_unit,
                    unit,
                    burst,
                    max_debt,
                    algorithm,
                },
                name,
            ))
        }
        _ => None,
    }
}
