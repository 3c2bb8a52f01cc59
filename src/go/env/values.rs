//! Parsers of the Go service's value syntaxes (`strconv.ParseBool`,
//! `time.ParseDuration`, logrus levels, listen addresses, Redis addresses).

use super::{GoEnvError, refuse};

/// Parses a Go `strconv.ParseBool` value (`1 t T TRUE true True`, `0 f F
/// FALSE false False`).
///
/// # Errors
/// [`GoEnvError`] naming `var` for anything else.
pub fn go_bool(var: &str, v: &str) -> Result<bool, GoEnvError> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(refuse(
            var,
            format!("'{v}' is not a boolean (true or false)"),
        )),
    }
}

/// Parses a Go `time.ParseDuration` value (`10s`, `1.5s`, `250ms`,
/// `1m30s`, `0`; units `ns`, `us`, `µs`, `ms`, `s`, `m`, `h`) into
/// milliseconds, rounded up to whole milliseconds.
///
/// # Errors
/// A message for a malformed value.
pub fn go_duration_ms(v: &str) -> Result<u64, String> {
    if v == "0" {
        return Ok(0);
    }
    let bad = || format!("'{v}' is not a duration (such as 250ms, 10s, 1m30s)");
    let mut rest = v;
    let mut total_ns: f64 = 0.0;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let n = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let number: f64 = rest[..n].parse().map_err(|_| bad())?;
        rest = &rest[n..];
        let u = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..u] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3_600e9,
            _ => return Err(bad()),
        };
        total_ns += number * scale;
        rest = &rest[u..];
    }
    Ok((total_ns / 1e6).ceil() as u64)
}

/// Maps a logrus level name (case-insensitive) onto `--log-level`.
pub(super) fn log_level(v: &str) -> Result<&'static str, GoEnvError> {
    Ok(match v.to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warn" | "warning" => "warn",
        "error" | "fatal" | "panic" => "error",
        _ => {
            return Err(refuse(
                "LOG_LEVEL",
                format!("'{v}' is not a level: trace, debug, info, warn, error, fatal or panic"),
            ));
        }
    })
}

/// `host:port` of a listen address, with an IPv6 host (`::`) in brackets
/// and an empty host meaning every IPv4 address, as Go's `net.Listen` does.
pub(super) fn listen_addr(host: &str, port: &str) -> String {
    // `localhost` is the one host name the Go service's listeners commonly
    // get; the flags take addresses.
    let host = match host {
        "" => "0.0.0.0",
        "localhost" => "127.0.0.1",
        h => h,
    };
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Percent-encodes a user name or password for a URL's user info.
fn userinfo(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// `redis://` (or `rediss://` with `tls`) URL for a `REDIS_URL` element,
/// with `auth` (`password` or `user:password`) as its user info. An element
/// that already has a scheme is kept as given.
pub(super) fn redis_url(addr: &str, tls: bool, auth: Option<&str>) -> String {
    if addr.contains("://") {
        return addr.to_owned();
    }
    let scheme = if tls { "rediss" } else { "redis" };
    match auth.filter(|a| !a.is_empty()) {
        None => format!("{scheme}://{addr}"),
        Some(a) => match a.split_once(':') {
            Some((user, pw)) => format!("{scheme}://{}:{}@{addr}", userinfo(user), userinfo(pw)),
            None => format!("{scheme}://:{}@{addr}", userinfo(a)),
        },
    }
}
