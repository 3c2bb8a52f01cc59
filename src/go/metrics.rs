//! The Go reference service's metric names, for deployments that read them
//! (Envoy Gateway's dashboard, e2e tests): [`render_metrics`] is `/metrics`
//! under the Go service's names, as Envoy Gateway's statsd mapper exposes
//! them
//! (`ratelimit_service_rate_limit_{total_hits,over_limit,near_limit,within_limit,shadow_mode}`
//! with labels `domain`, `key1`, `key2`; `ratelimit_service_config_load_{success,error}`;
//! `ratelimit_service_total_requests` and `ratelimit_service_response_time_seconds`
//! with `grpc_method`; `ratelimit_service_should_rate_limit_error` with
//! `err_type`; process metrics). Translated at scrape time from
//! bucket-rls's own series, so the request path records nothing twice and
//! the cardinality is that of the native series (bounded by
//! [`crate::limiter::labels`]).
//!
//! Label rule (the Go service's stat key and Envoy Gateway's mapper): the
//! rule path `domain.key_value.key2_value2...` with `:` and `|` as `_` and
//! the dots of IPv4 addresses as `_`; segment 1 is `domain`, 2 `key1`, 3
//! `key2`; deeper segments are dropped (their counts summed).

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// bucket-rls counter -> Go name, for the per-rule counters.
const RULE_COUNTERS: [(&str, &str); 5] = [
    (
        crate::metrics::TOTAL_HITS,
        "ratelimit_service_rate_limit_total_hits",
    ),
    (
        crate::metrics::OVER_LIMIT,
        "ratelimit_service_rate_limit_over_limit",
    ),
    (
        crate::metrics::NEAR_LIMIT,
        "ratelimit_service_rate_limit_near_limit",
    ),
    (
        crate::metrics::WITHIN_LIMIT,
        "ratelimit_service_rate_limit_within_limit",
    ),
    (
        crate::metrics::SHADOW_MODE,
        "ratelimit_service_rate_limit_shadow_mode",
    ),
];

/// Go name of the response time histogram. Its values are milliseconds,
/// as Envoy Gateway's mapper exposes the Go service's timer (no scaling).
pub const RESPONSE_TIME: &str = "ratelimit_service_response_time_seconds";

/// One sample of the text exposition: name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

/// Parses `name{a="x",b="y"} value` (label values unescaped); `None` for
/// comments and anything else.
fn parse_sample(line: &str) -> Option<Sample> {
    if line.starts_with('#') || line.is_empty() {
        return None;
    }
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices();
        let mut key = String::new();
        loop {
            let (_, c) = chars.next()?;
            match c {
                '}' => {
                    rest = &r[chars.next().map_or(r.len(), |(i, _)| i)..];
                    break;
                }
                ',' => {}
                '=' => {
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            '"' => break,
                            other => value.push(other),
                        }
                    }
                    labels.push((std::mem::take(&mut key), value));
                }
                other => key.push(other),
            }
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

fn label<'a>(labels: &'a [(String, String)], key: &str) -> Option<&'a str> {
    labels
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// The dots of IPv4 addresses (four groups of 1 to 3 digits) in `s` as `_`.
fn ipv4_dots(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    while i < b.len() {
        let starts = b[i].is_ascii_digit() && (i == 0 || !(b[i - 1].is_ascii_digit()));
        if starts {
            // Try four dot-separated digit groups from here.
            let (mut j, mut groups, mut dots) = (i, 0, Vec::new());
            while groups < 4 {
                let g = j;
                while j < b.len() && b[j].is_ascii_digit() && j - g < 4 {
                    j += 1;
                }
                if j == g || j - g > 3 {
                    break;
                }
                groups += 1;
                if groups < 4 {
                    if j < b.len() && b[j] == b'.' {
                        dots.push(j);
                        j += 1;
                    } else {
                        break;
                    }
                }
            }
            if groups == 4 && (j == b.len() || !b[j].is_ascii_digit()) {
                for d in dots {
                    out[d] = b'_';
                }
                i = j;
                continue;
            }
        }
        i += 1;
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_owned())
}

/// `(domain, key1, key2)` of a rule path under the Go label rule.
#[must_use]
pub fn stat_labels(rule: &str) -> (String, String, String) {
    let clean = ipv4_dots(&rule.replace([':', '|'], "_"));
    let mut seg = clean.split('.');
    let mut next = || seg.next().unwrap_or_default().to_owned();
    (next(), next(), next())
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// Translates bucket-rls's exposition `native` into the Go names (see the
/// module doc). Series not mapped are left out.
#[must_use]
pub fn translate(native: &str) -> String {
    let mut rules: BTreeMap<(&str, (String, String, String)), f64> = BTreeMap::new();
    let (mut loads_ok, mut loads_err) = (0.0, 0.0);
    let mut errors: BTreeMap<&str, f64> = BTreeMap::new();
    let mut buckets: Vec<(String, f64)> = Vec::new();
    let (mut sum, mut count) = (0.0, 0.0);
    for (name, labels, value) in native.lines().filter_map(parse_sample) {
        if let Some((_, go)) = RULE_COUNTERS.iter().find(|(n, _)| *n == name) {
            if let Some(rule) = label(&labels, "rule") {
                *rules.entry((go, stat_labels(rule))).or_default() += value;
            }
        } else if name == crate::metrics::CONFIG_LOAD {
            match label(&labels, "result") {
                Some("success") => loads_ok += value,
                Some("error") => loads_err += value,
                _ => {}
            }
        } else if name == crate::metrics::SERVICE_ERROR {
            let kind = if label(&labels, "kind") == Some("storage") {
                "redis_error"
            } else {
                "service_error"
            };
            *errors.entry(kind).or_default() += value;
        } else if let Some(h) = name.strip_prefix(crate::metrics::REQUEST_DURATION) {
            match h {
                "_bucket" => {
                    let le = match label(&labels, "le") {
                        Some("+Inf") | None => "+Inf".to_owned(),
                        Some(s) => s
                            .parse::<f64>()
                            .map_or_else(|_| s.to_owned(), |secs| num_ms(secs * 1000.0)),
                    };
                    buckets.push((le, value));
                }
                "_sum" => sum += value * 1000.0,
                "_count" => count += value,
                _ => {}
            }
        }
    }
    let mut out = String::new();
    let mut last = "";
    for ((go, (domain, key1, key2)), v) in &rules {
        if *go != last {
            head(&mut out, go, "Per-rule hits, under the Go service's name");
            last = go;
        }
        let _ = writeln!(
            out,
            "{go}{{domain=\"{}\",key1=\"{}\",key2=\"{}\"}} {}",
            escape(domain),
            escape(key1),
            escape(key2),
            num(*v)
        );
    }
    for (name, help, v) in [
        (
            "ratelimit_service_config_load_success",
            "Config loads that succeeded",
            loads_ok,
        ),
        (
            "ratelimit_service_config_load_error",
            "Config loads that failed",
            loads_err,
        ),
    ] {
        head(&mut out, name, help);
        let _ = writeln!(out, "{name} {}", num(v));
    }
    let m = "grpc_method=\"ShouldRateLimit\"";
    head(
        &mut out,
        "ratelimit_service_total_requests",
        "ShouldRateLimit calls answered",
    );
    let _ = writeln!(
        out,
        "ratelimit_service_total_requests{{{m}}} {}",
        num(count)
    );
    if !errors.is_empty() {
        head(
            &mut out,
            "ratelimit_service_should_rate_limit_error",
            "ShouldRateLimit calls answered with an error, by kind",
        );
        for (kind, v) in &errors {
            let _ = writeln!(
                out,
                "ratelimit_service_should_rate_limit_error{{err_type=\"{kind}\"}} {}",
                num(*v)
            );
        }
    }
    if !buckets.is_empty() {
        let _ = writeln!(
            out,
            "# HELP {RESPONSE_TIME} ShouldRateLimit latency in milliseconds, as the Go service's timer (the name says seconds)\n# TYPE {RESPONSE_TIME} histogram"
        );
        for (le, v) in &buckets {
            let _ = writeln!(out, "{RESPONSE_TIME}_bucket{{{m},le=\"{le}\"}} {}", num(*v));
        }
        let _ = writeln!(out, "{RESPONSE_TIME}_sum{{{m}}} {sum}");
        let _ = writeln!(out, "{RESPONSE_TIME}_count{{{m}}} {}", num(count));
    }
    out
}

/// The `HELP` and `TYPE` lines of a Go counter. The Go service's counter
/// names do not end in `_total`, which the text format reserves for
/// counters, so they are typed `untyped` (Prometheus treats both alike in
/// queries): the exposition passes `promtool check metrics` with the names
/// unchanged.
fn head(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} untyped");
}

/// A bucket bound in milliseconds, without float noise (`0.25`, not
/// `0.25000000000000006`).
fn num_ms(ms: f64) -> String {
    let rounded = (ms * 1e6).round() / 1e6;
    num(rounded)
}

/// The Go-named exposition of this process: [`translate`] of the
/// process-wide recorder, then the process metrics.
#[must_use]
pub fn render_metrics() -> String {
    let mut out = translate(&crate::metrics::install().render());
    out.push_str(&crate::metrics::process_metrics());
    out
}

/// The router of the Go-named metrics listener (`--go-metrics-addr`):
/// `GET <path>` answers [`render_metrics`].
pub fn router(path: &str) -> axum::Router {
    crate::metrics::install();
    axum::Router::new().route(
        path,
        axum::routing::get(|| async {
            (
                [(
                    axum::http::header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                render_metrics(),
            )
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_labels_follow_the_go_key_rule() {
        assert_eq!(
            stat_labels("d.k_v.masked_remote_address_0.0.0.0/0"),
            (
                "d".into(),
                "k_v".into(),
                "masked_remote_address_0_0_0_0/0".into()
            )
        );
        assert_eq!(stat_labels("d"), ("d".into(), String::new(), String::new()));
        assert_eq!(
            stat_labels("d.a:b|c.x.deeper"),
            ("d".into(), "a_b_c".into(), "x".into())
        );
        // Not an address: five groups, or a version number.
        assert_eq!(ipv4_dots("v1.2.3"), "v1.2.3");
        assert_eq!(ipv4_dots("ip_10.1.22.255_x"), "ip_10_1_22_255_x");
        assert_eq!(ipv4_dots("1.2.3.4444"), "1.2.3.4444");
    }

    #[test]
    fn translate_renames_sums_deeper_segments_and_scales_the_timer_to_ms() {
        let native = "\
# TYPE bucket_rls_over_limit_total counter
bucket_rls_over_limit_total{rule=\"d.k_v.x_1\"} 2
bucket_rls_over_limit_total{rule=\"d.k_v.x_1.deep_a\"} 3
bucket_rls_hits_total{rule=\"d.k_v\"} 7
bucket_rls_config_load_total{result=\"success\"} 1
bucket_rls_service_error_total{kind=\"storage\"} 4
bucket_rls_request_duration_seconds_bucket{le=\"0.00025\"} 5
bucket_rls_request_duration_seconds_bucket{le=\"+Inf\"} 9
bucket_rls_request_duration_seconds_sum 0.002
bucket_rls_request_duration_seconds_count 9
";
        let go = translate(native);
        for line in [
            "ratelimit_service_rate_limit_over_limit{domain=\"d\",key1=\"k_v\",key2=\"x_1\"} 5",
            "ratelimit_service_rate_limit_total_hits{domain=\"d\",key1=\"k_v\",key2=\"\"} 7",
            "ratelimit_service_config_load_success 1",
            "ratelimit_service_config_load_error 0",
            "ratelimit_service_should_rate_limit_error{err_type=\"redis_error\"} 4",
            "ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"} 9",
            "ratelimit_service_response_time_seconds_bucket{grpc_method=\"ShouldRateLimit\",le=\"0.25\"} 5",
            "ratelimit_service_response_time_seconds_bucket{grpc_method=\"ShouldRateLimit\",le=\"+Inf\"} 9",
            "ratelimit_service_response_time_seconds_sum{grpc_method=\"ShouldRateLimit\"} 2",
        ] {
            assert!(go.lines().any(|l| l == line), "missing {line}:\n{go}");
        }
        assert!(!go.contains("bucket_rls_"), "{go}");
    }

    #[test]
    fn label_values_with_quotes_and_escapes_survive_the_round_trip() {
        let native = "bucket_rls_over_limit_total{rule=\"d.k_a\\\"b\\\\c\"} 1\n";
        let go = translate(native);
        assert!(go.contains("key1=\"k_a\\\"b\\\\c\""), "{go}");
    }
}
