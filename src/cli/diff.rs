//! `check-config --diff OLD NEW`: compares two configs rule by rule and says
//! what happens to existing buckets. OLD is a config file or directory, or
//! a running replica's `/rlconfig` fetched over plain HTTP.

use std::io::Write;
use std::path::PathBuf;

/// How NEW compares with OLD (`main` maps each to an exit code: 0, 2, 3
/// and 1 in the order below).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No rule changed.
    Unchanged,
    /// Only additions and loosenings.
    AddsOrLoosens,
    /// A change to review: tightened, removed, mixed, or a mode changed.
    NeedsReview,
    /// A side does not load (or the arguments are wrong); the problems went
    /// to the error output.
    NotLoaded,
}

/// `check-config --diff OLD NEW` with `paths` holding NEW: checks that there
/// is exactly one NEW, then runs [`diff_configs`] on a runtime of its own
/// (the fetch of a replica's `/rlconfig` is async).
pub fn run(
    old: &str,
    paths: &[PathBuf],
    load: crate::config::compile::LoadOptions,
    algorithm_given: bool,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Verdict {
    let [new] = paths else {
        let _ = writeln!(
            err,
            "error: check-config --diff OLD takes exactly one NEW config (file or directory), got {}",
            paths.len()
        );
        return Verdict::NotLoaded;
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = writeln!(err, "error: cannot start the async runtime: {e}");
            return Verdict::NotLoaded;
        }
    };
    rt.block_on(diff_configs(old, new, load, algorithm_given, out, err))
}

/// `check-config --diff OLD NEW`: loads both sides, writes one line per
/// changed rule and a summary to `out`, problems to `err`.
///
/// `old` is a path, or an `http://` URL of a replica's `/rlconfig` (plain
/// HTTP, as the admin port serves it; 10 s timeout). Against a replica,
/// NEW is loaded with the replica's `--default-algorithm` (from `/rlconfig`'s
/// `modes`) unless `algorithm_given` (`load.default_algorithm` came from
/// the command line: it wins, with a note to `err` when the replica's
/// differs); a replica that does not state it is read as
/// `load.default_algorithm`.
pub async fn diff_configs(
    old: &str,
    new: &std::path::Path,
    mut load: crate::config::compile::LoadOptions,
    algorithm_given: bool,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Verdict {
    use crate::config::diff;
    use crate::storage::AlgorithmKind;
    // A file's rules are compared with a replica's under the replica's
    // service-wide settings (`--max-debt-bursts`, which its debt bounds
    // include, and `--default-algorithm`); with files on both sides, each
    // rule's own.
    let load_path = |p: &std::path::Path,
                     load: crate::config::compile::LoadOptions,
                     in_force,
                     err: &mut dyn Write| {
        crate::config::files::load_source_with(p, load)
            .map(|c| diff::rules_in_force(&c, in_force))
            .map_err(|errs| {
                for e in errs.0 {
                    let _ = writeln!(err, "{e}");
                }
            })
    };
    let (old_rules, in_force) = if old.starts_with("http://") || old.starts_with("https://") {
        match fetch_rlconfig(old)
            .await
            .and_then(|b| diff::rules_from_rlconfig(&b))
        {
            Ok((r, in_force)) => (Ok(r), in_force),
            Err(e) => {
                let _ = writeln!(err, "{old}: {e}");
                (Err(()), diff::InForce::default())
            }
        }
    } else {
        let in_force = diff::InForce::default();
        (
            load_path(std::path::Path::new(old), load, in_force, err),
            in_force,
        )
    };
    let replica_algorithm = in_force.default_algorithm;
    match replica_algorithm {
        Some(theirs) if algorithm_given && theirs != load.default_algorithm => {
            let _ = writeln!(
                err,
                "note: {old} serves with --default-algorithm {theirs}; NEW's rules that name no algorithm are compared as {} (check-config --default-algorithm)",
                load.default_algorithm
            );
        }
        Some(theirs) if !algorithm_given => load.default_algorithm = theirs,
        _ => {}
    }
    let new_rules = load_path(new, load, in_force, err);
    if new_rules.is_err()
        && !algorithm_given
        && let Some(theirs) = replica_algorithm.filter(|a| !matches!(a, AlgorithmKind::TokenBucket))
    {
        let _ = writeln!(
            err,
            "note: {} was loaded with {old}'s --default-algorithm {theirs} (/rlconfig modes.default_algorithm), as the replica would load it",
            new.display()
        );
    }
    let (Ok(old_rules), Ok(new_rules)) = (old_rules, new_rules) else {
        return Verdict::NotLoaded;
    };
    let changes = diff::diff(&old_rules, &new_rules);
    for c in &changes {
        let _ = writeln!(out, "{}", c.line);
    }
    let _ = writeln!(out, "{}", diff::summary(&changes));
    if changes.is_empty() {
        Verdict::Unchanged
    } else if changes.iter().any(|c| c.kind.needs_review()) {
        Verdict::NeedsReview
    } else {
        Verdict::AddsOrLoosens
    }
}

/// `GET url` over plain HTTP/1.1; the body of a 200 answer (at most 64 MiB).
async fn fetch_rlconfig(url: &str) -> Result<Vec<u8>, String> {
    use http_body_util::{BodyExt, Empty, Limited};
    let uri: hyper::Uri = url.parse().map_err(|e| format!("not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err("only http:// is supported (the admin port serves plain HTTP)".to_owned());
    }
    let host = uri.host().ok_or("the URL has no host")?.to_owned();
    let port = uri.port_u16().unwrap_or(80);
    let fetch = async {
        let stream = tokio::net::TcpStream::connect((host.trim_matches(['[', ']']), port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| format!("HTTP: {e}"))?;
        tokio::spawn(conn);
        let req = hyper::Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
            .header(
                hyper::header::HOST,
                uri.authority().map_or(host.as_str(), |a| a.as_str()),
            )
            .body(Empty::<bytes::Bytes>::new())
            .map_err(|e| format!("request: {e}"))?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("HTTP: {e}"))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), 64 << 20)
            .collect()
            .await
            .map_err(|e| format!("reading the body: {e}"))?
            .to_bytes();
        if status != hyper::StatusCode::OK {
            return Err(format!("answered {status}"));
        }
        Ok(body.to_vec())
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), fetch)
        .await
        .map_err(|_| "no answer within 10 s".to_owned())?
}
