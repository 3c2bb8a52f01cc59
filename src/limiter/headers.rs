//! The optional RateLimit response headers (`--rate-limit-headers`), chosen
//! from the statuses of one decision. `retry-after` is not here: it is sent on
//! every `OverLimit`, see [`super::verdict`].

use super::verdict::{Code, Decision, Header};
use crate::settings::{HeaderNames, RateLimitHeaders};
use std::cmp::Reverse;

/// Adds the RateLimit headers of `mode` to `decision`. `limited` holds the
/// index and unit length (seconds) of every non-shadow status that carries a
/// limit; `denials` the indices of the statuses that deny the request. On
/// `OverLimit` the headers describe the denial with the longest wait (the one
/// `retry-after` reports), first on ties; otherwise the most restrictive
/// status: strictly smallest `limit_remaining`, first on ties (Envoy's rule
/// for its own `X-RateLimit-*` headers). [`RateLimitHeaders::Go`] uses
/// `names`.
pub fn add(
    mode: RateLimitHeaders,
    names: &HeaderNames,
    decision: &mut Decision,
    limited: &[(usize, u64)],
    denials: &[usize],
) {
    if mode == RateLimitHeaders::Off {
        return;
    }
    let statuses = &decision.statuses;
    let over = decision.overall_code == Code::OverLimit;
    let wait = |i: usize| statuses[i].duration_until_reset.unwrap_or_default();
    let chosen = if over {
        limited
            .iter()
            .filter(|(i, _)| denials.contains(i))
            .max_by_key(|(i, _)| (wait(*i), Reverse(*i)))
    } else {
        limited
            .iter()
            .min_by_key(|(i, _)| (statuses[*i].limit_remaining, *i))
    };
    let Some(&(tightest, _)) = chosen else {
        return;
    };
    let st = &statuses[tightest];
    let reset = st
        .duration_until_reset
        .map_or(0, |d| d.as_secs() + u64::from(d.subsec_nanos() > 0));
    let rpu = |i: usize| {
        statuses[i]
            .current_limit
            .as_ref()
            .map_or(0, |l| l.requests_per_unit)
    };
    let name = |i: usize| {
        let n = statuses[i]
            .current_limit
            .as_ref()
            .map_or("", |l| l.name.as_str());
        if n.is_empty() {
            format!("limit{i}")
        } else {
            n.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || "_-.:/".contains(c) {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        }
    };
    let header = |key: &'static str, value| Header {
        key: key.into(),
        value,
    };
    let headers = match mode {
        RateLimitHeaders::Off => return,
        RateLimitHeaders::Go => vec![
            Header {
                key: names.limit.clone().into(),
                value: rpu(tightest).to_string(),
            },
            Header {
                key: names.remaining.clone().into(),
                value: st.limit_remaining.to_string(),
            },
            Header {
                key: names.reset.clone().into(),
                value: reset.to_string(),
            },
        ],
        RateLimitHeaders::Draft03 => {
            let mut limit = rpu(tightest).to_string();
            for (i, secs) in limited {
                limit.push_str(&format!(", {};w={secs}", rpu(*i)));
            }
            vec![
                header("ratelimit-limit", limit),
                header("ratelimit-remaining", st.limit_remaining.to_string()),
                header("ratelimit-reset", reset.to_string()),
            ]
        }
        RateLimitHeaders::Ietf => {
            let policy = limited
                .iter()
                .map(|(i, secs)| format!("\"{}\";q={};w={secs}", name(*i), rpu(*i)))
                .collect::<Vec<_>>()
                .join(", ");
            vec![
                header("ratelimit-policy", policy),
                header(
                    "ratelimit",
                    format!("\"{}\";r={};t={reset}", name(tightest), st.limit_remaining),
                ),
            ]
        }
    };
    decision.response_headers_to_add.extend(headers);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Unit;
    use crate::limiter::verdict::{CurrentLimit, DescriptorStatus};
    use std::time::Duration;

    fn status(code: Code, name: &str, rpu: u32, remaining: u32, secs: u64) -> DescriptorStatus {
        DescriptorStatus {
            code,
            current_limit: Some(CurrentLimit {
                name: name.into(),
                requests_per_unit: rpu,
                unit: Unit::Minute,
            }),
            limit_remaining: remaining,
            duration_until_reset: Some(Duration::from_secs(secs)),
        }
    }

    fn keys(d: &Decision) -> Vec<(&str, &str)> {
        d.response_headers_to_add
            .iter()
            .map(|h| (h.key.as_ref(), h.value.as_str()))
            .collect()
    }

    #[test]
    fn within_limits_the_smallest_remaining_is_announced() {
        let mut d = Decision::ok(vec![
            status(Code::Ok, "a", 10, 7, 3),
            status(Code::Ok, "b b", 5, 2, 30),
            status(Code::Ok, "c", 5, 2, 9),
        ]);
        let all = [(0, 60), (1, 60), (2, 60)];
        let names = HeaderNames::default();
        add(RateLimitHeaders::Draft03, &names, &mut d, &all, &[]);
        assert_eq!(
            keys(&d),
            vec![
                ("ratelimit-limit", "5, 10;w=60, 5;w=60, 5;w=60"),
                ("ratelimit-remaining", "2"),
                ("ratelimit-reset", "30"),
            ]
        );
        let mut d = Decision::ok(vec![status(Code::Ok, "b b", 5, 2, 30)]);
        add(RateLimitHeaders::Ietf, &names, &mut d, &[(0, 60)], &[]);
        assert_eq!(
            keys(&d),
            vec![
                ("ratelimit-policy", "\"b_b\";q=5;w=60"),
                ("ratelimit", "\"b_b\";r=2;t=30"),
            ]
        );
    }

    #[test]
    fn over_limit_announces_the_longest_denial() {
        let mut d = Decision::ok(vec![
            status(Code::OverLimit, "short", 10, 0, 3),
            status(Code::Ok, "roomy", 10, 0, 1),
            status(Code::OverLimit, "long", 10, 0, 3600),
        ]);
        d.overall_code = Code::OverLimit;
        let names = HeaderNames::default();
        let all = [(0, 60), (1, 60), (2, 60)];
        add(RateLimitHeaders::Draft03, &names, &mut d, &all, &[0, 2]);
        assert!(keys(&d).contains(&("ratelimit-reset", "3600")));
        // Only denials count: a quota status over its limit that another
        // quota status outweighs is not the one announced.
        d.response_headers_to_add.clear();
        add(RateLimitHeaders::Draft03, &names, &mut d, &all, &[0]);
        assert!(keys(&d).contains(&("ratelimit-reset", "3")));
    }

    #[test]
    fn go_headers_carry_the_bare_limit_under_configured_names() {
        let mut d = Decision::ok(vec![status(Code::Ok, "a", 10, 7, 3)]);
        let names = HeaderNames {
            limit: "X-Limit".into(),
            remaining: "X-Left".into(),
            reset: "X-Reset".into(),
        };
        add(RateLimitHeaders::Go, &names, &mut d, &[(0, 60)], &[]);
        assert_eq!(
            keys(&d),
            vec![("X-Limit", "10"), ("X-Left", "7"), ("X-Reset", "3")]
        );
    }

    #[test]
    fn nothing_is_added_when_off_or_without_limits() {
        let mut d = Decision::ok(vec![status(Code::Ok, "a", 1, 1, 1)]);
        let names = HeaderNames::default();
        add(RateLimitHeaders::Off, &names, &mut d, &[(0, 60)], &[]);
        add(RateLimitHeaders::Ietf, &names, &mut d, &[], &[]);
        assert!(d.response_headers_to_add.is_empty());
    }
}
