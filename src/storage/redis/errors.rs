//! Redis errors classified into [`StorageError`]s, in one place (docs/design.md, "Storage failures"),
//! with the URL's password removed from every message.

use crate::storage::{BackendKind, ErrorSource, StorageError};
use ::redis::{ErrorKind, RedisError, ServerErrorKind};

/// Classifies a Redis error into a [`StorageError`]:
///
/// - timeouts: [`StorageError::Timeout`] (outcome unknown, never replayed);
/// - connection refused, reset or dropped, other I/O errors:
///   [`StorageError::Unreachable`];
/// - server errors by their code (`READONLY`, `CLUSTERDOWN`, `LOADING`,
///   `MASTERDOWN`, `TRYAGAIN`, `MOVED`, `ASK`, `CROSSSLOT`, `NOSCRIPT`,
///   `NOPERM`, `BUSY`, `OOM`, `WRONGTYPE`), other script errors as `script`,
///   authentication (`NOAUTH`, `WRONGPASS`, a failed handshake) as `auth`, malformed replies as `reply`, anything else as
///   `redis`: [`StorageError::Backend`] with that [`BackendKind`].
///
/// `timeout` is the configured response timeout (reported in the error).
/// `secret` (the password from the URL, if any) is removed from messages;
/// the error is kept as the source (redacted too when it shows the secret).
#[must_use]
pub(crate) fn classify(
    e: &RedisError,
    timeout: std::time::Duration,
    secret: Option<&str>,
) -> StorageError {
    if e.is_timeout() {
        return StorageError::Timeout(timeout);
    }
    let message = redact(&e.to_string(), secret);
    if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        return StorageError::Unreachable {
            source: Some(source(e, &message)),
            message,
        };
    }
    let kind = match e.kind() {
        ErrorKind::Server(ServerErrorKind::ReadOnly) => BackendKind::ReadOnly,
        ErrorKind::Server(ServerErrorKind::ClusterDown) => BackendKind::ClusterDown,
        ErrorKind::Server(ServerErrorKind::BusyLoading) => BackendKind::Loading,
        ErrorKind::Server(ServerErrorKind::MasterDown) => BackendKind::MasterDown,
        ErrorKind::Server(ServerErrorKind::TryAgain) => BackendKind::TryAgain,
        ErrorKind::Server(ServerErrorKind::Moved) => BackendKind::Moved,
        ErrorKind::Server(ServerErrorKind::Ask) => BackendKind::Ask,
        ErrorKind::Server(ServerErrorKind::CrossSlot) => BackendKind::CrossSlot,
        ErrorKind::Server(ServerErrorKind::NoScript) => BackendKind::NoScript,
        ErrorKind::Server(ServerErrorKind::NoPerm) => BackendKind::NoPerm,
        ErrorKind::AuthenticationFailed => BackendKind::Auth,
        ErrorKind::UnexpectedReturnType | ErrorKind::Parse => BackendKind::Reply,
        // Codes the client has no kind for: a script running too long
        // (BUSY), memory full (OOM), a foreign value under a bucket's name.
        _ => match e.code() {
            Some("BUSY") => BackendKind::Busy,
            Some("OOM") => BackendKind::Oom,
            Some("WRONGTYPE") => BackendKind::WrongType,
            // A server that wants a password or refused ours (it restarted
            // with `requirepass`, the ACL user changed): the client library
            // reports these as plain server errors.
            Some("NOAUTH" | "WRONGPASS") => BackendKind::Auth,
            // The library lost again between its reload and the retry
            // (`FUNCTION FLUSH` twice): `NOSCRIPT`'s case for a function.
            _ if super::script::function_missing(e) => BackendKind::NoScript,
            _ if message.contains("script") => BackendKind::Script,
            _ => BackendKind::Redis,
        },
    };
    StorageError::Backend {
        kind,
        source: Some(source(e, &message)),
        message,
    }
}

/// `e` itself as the source of a [`StorageError`], or, when its message
/// shows a secret (`redacted` differs from it), the redacted message alone.
fn source(e: &RedisError, redacted: &str) -> ErrorSource {
    if e.to_string() == redacted {
        Box::new(e.clone())
    } else {
        Box::new(Redacted(redacted.to_owned()))
    }
}

/// A client error whose message showed a password, with the password
/// replaced by `***`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Redacted(String);

/// Replaces every occurrence of `secret` in `s` with `***`.
#[must_use]
pub(crate) fn redact(s: &str, secret: Option<&str>) -> String {
    match secret {
        Some(p) if !p.is_empty() => s.replace(p, "***"),
        _ => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;
    use std::time::Duration;

    #[test]
    fn secrets_are_redacted() {
        assert_eq!(
            redact("auth s3cret failed", Some("s3cret")),
            "auth *** failed"
        );
        assert_eq!(redact("x", None), "x");
    }

    #[test]
    fn server_errors_keep_their_code_and_their_source() {
        let t = Duration::from_millis(50);
        let readonly = RedisError::from((
            ErrorKind::Server(ServerErrorKind::ReadOnly),
            "You can't write against a read only replica.",
        ));
        let e = classify(&readonly, t, None);
        assert_eq!(e.kind(), "READONLY");
        assert!(e.is_transient());
        assert!(e.source().is_some());
        let script = RedisError::from((
            ErrorKind::Server(ServerErrorKind::ResponseError),
            "ERR user_script:1: bad script",
        ));
        let e = classify(&script, t, None);
        assert_eq!(e.kind(), "script");
        assert!(!e.is_transient());
        let missing = ::redis::parse_redis_value(b"-ERR Function not found\r\n")
            .expect("an error reply")
            .extract_error()
            .expect_err("a server error");
        assert_eq!(classify(&missing, t, None).kind(), "NOSCRIPT");
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(classify(&refused, t, None).kind(), "unreachable");
    }

    #[test]
    fn a_source_that_shows_the_password_is_redacted_too() {
        let e = RedisError::from((
            ErrorKind::Server(ServerErrorKind::ResponseError),
            "ERR near",
            "pw=S3CRETPW".to_owned(),
        ));
        let e = classify(&e, Duration::from_millis(50), Some("S3CRETPW"));
        let source = e.source().expect("source").to_string();
        assert!(!e.to_string().contains("S3CRETPW"), "{e}");
        assert!(!source.contains("S3CRETPW"), "{source}");
        assert!(source.contains("pw=***"), "{source}");
    }

    #[test]
    fn noauth_and_wrongpass_are_auth_failures() {
        for (code, text) in [
            ("NOAUTH", "Authentication required."),
            (
                "WRONGPASS",
                "invalid username-password pair or user is disabled.",
            ),
        ] {
            let reply = ::redis::parse_redis_value(format!("-{code} {text}\r\n").as_bytes())
                .expect("an error reply");
            let parsed = reply.extract_error().expect_err("a server error");
            assert_eq!(
                classify(&parsed, Duration::from_millis(50), None).kind(),
                "auth",
                "{code}: {parsed:?}"
            );
        }
    }
}
