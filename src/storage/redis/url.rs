//! Redis addresses: URLs with their password redacted for logs and errors,
//! and the password itself (to remove it from error messages).

/// Node addresses (`host:port` or URLs) as URLs, the same list with passwords
/// masked (for logs and errors), and the first password (to redact it from
/// error messages).
pub(crate) fn node_urls(nodes: &[String]) -> (Vec<String>, String, Option<String>) {
    let urls: Vec<String> = nodes
        .iter()
        .map(|n| {
            if n.contains("://") {
                n.clone()
            } else {
                format!("redis://{n}")
            }
        })
        .collect();
    let shown = urls
        .iter()
        .map(|u| redact_url(u))
        .collect::<Vec<_>>()
        .join(",");
    let secret = urls.iter().find_map(|u| url_password(u));
    (urls, shown, secret)
}

/// Splits `url` into (prefix up to and including `://`, user info, the rest
/// from the last `@` on). The user info runs to the **last** `@`, so a password
/// holding `/`, `#`, `?` or `@` (common in generated passwords), or a URL
/// without a scheme, still never leaks.
fn split_userinfo(url: &str) -> Option<(&str, &str, &str)> {
    let start = url.find("://").map_or(0, |i| i + 3);
    let at = url.rfind('@').filter(|&at| at >= start)?;
    Some((&url[..start], &url[start..at], &url[at..]))
}

/// Whether a query parameter name carries a password: `pass` is how the
/// `redis` crate reads one from `redis+unix://` and `unix://` URLs;
/// `password` is a common guess (the crate ignores it on TCP URLs, but it
/// must not be logged either).
pub(crate) fn is_secret_param(name: &str) -> bool {
    name.eq_ignore_ascii_case("pass") || name.eq_ignore_ascii_case("password")
}

pub(crate) fn url_password(url: &str) -> Option<String> {
    if let Some((_, userinfo, _)) = split_userinfo(url)
        && let Some((_, password)) = userinfo.split_once(':')
        && !password.is_empty()
    {
        return Some(password.to_owned());
    }
    let (_, query) = url.split_once('?')?;
    query
        .split('&')
        .filter_map(|p| p.split_once('='))
        .find(|(name, value)| is_secret_param(name) && !value.is_empty())
        .map(|(_, value)| value.to_owned())
}

/// `url` with the password of its user info and the value of any `pass=` or
/// `password=` query parameter replaced by `***`, for logs and errors
/// (`redis://user:***@host:6379/0`, `redis+unix:///run/redis.sock?pass=***`).
/// Works on URLs that do not parse.
#[must_use]
pub fn redact_url(url: &str) -> String {
    let url = match split_userinfo(url) {
        Some((scheme, userinfo, host)) => {
            let masked = match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                // `redis://password@host` is read as a password by some clients.
                None => "***".to_owned(),
            };
            format!("{scheme}{masked}{host}")
        }
        None => url.to_owned(),
    };
    match url.split_once('?') {
        Some((base, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((name, _)) if is_secret_param(name) => format!("{name}=***"),
                    _ => p.to_owned(),
                })
                .collect();
            format!("{base}?{}", query.join("&"))
        }
        None => url,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::redis::errors::redact;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("redis://app:s3cret@db:6379/2"),
            "redis://app:***@db:6379/2"
        );
        assert_eq!(redact_url("rediss://:s3cret@db"), "rediss://:***@db");
        assert_eq!(redact_url("redis://db:6379"), "redis://db:6379");
        assert_eq!(
            url_password("redis://app:s3cret@db:6379/2").as_deref(),
            Some("s3cret")
        );
        assert_eq!(url_password("redis://db:6379"), None);
        // Passwords with URL delimiters, and URLs without a scheme.
        for (url, want) in [
            (
                "redis://:S3CRET/PW@127.0.0.1:6379/0",
                "redis://:***@127.0.0.1:6379/0",
            ),
            ("redis://u:a#b?c@d@h:1", "redis://u:***@h:1"),
            ("app:S3CRETPW@127.0.0.1:6379/0", "app:***@127.0.0.1:6379/0"),
            (
                "redis+unix:///tmp/x.sock?db=1&pass=S3CRETPW",
                "redis+unix:///tmp/x.sock?db=1&pass=***",
            ),
            (
                "unix:///tmp/x.sock?user=app&PASS=S3CRETPW",
                "unix:///tmp/x.sock?user=app&PASS=***",
            ),
            (
                "redis://host/0?password=S3CRETPW",
                "redis://host/0?password=***",
            ),
        ] {
            assert_eq!(redact_url(url), want);
            let pw = url_password(url).expect("password");
            assert!(!redact(&format!("parse error near {pw}"), Some(&pw)).contains(&pw));
        }
    }
}
