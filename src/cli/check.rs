//! `check-config`: loads config files or directories with the service's own
//! loader (or, with `--xds-resources`, dumps of xDS resources with the xDS
//! source's mapping) and prints every problem; with `--diff` it compares two
//! configs instead ([`super::diff`]).

use std::io::Write;
use std::path::PathBuf;

/// Flags of `check-config`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Files or directories to check (each checked as one config source).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// Merge files that define the same domain (as `serve
    /// --merge-domain-config`).
    #[arg(long)]
    pub merge_domain_config: bool,
    /// The algorithm of every rule that names none (as `serve
    /// --default-algorithm`; token_bucket when not given). With `--diff`
    /// against a replica, NEW's rules get the replica's own (its
    /// `/rlconfig` states it) unless this is given.
    #[arg(long, value_parser = super::serve_args::algorithm_parser())]
    pub default_algorithm: Option<crate::storage::AlgorithmKind>,
    /// Compare against OLD (a config file or directory, or a running
    /// replica's `http://HOST:PORT/rlconfig`) instead of only checking:
    /// one line per rule added, removed, tightened or loosened, with what
    /// happens to existing buckets. Exit 0: no rule changed; 2: changes
    /// that only add or loosen; 3: changes that tighten, remove or change
    /// a mode (review them); 1: either side does not load.
    #[arg(long, value_name = "OLD")]
    pub diff: Option<String>,
    /// Each path is a YAML dump of xDS `RateLimitConfig` resources
    /// (documents separated by `---`, as a control plane's tests write
    /// them), checked as one pushed set.
    #[arg(long)]
    pub xds_resources: bool,
}

/// What `check-config` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// Every source (or dump) is valid.
    Valid,
    /// At least one is not (the problems went to the error output).
    Invalid,
    /// With `--diff`: how the two configs compare.
    Diff(super::diff::Verdict),
}

/// Runs `check-config` with `args`: the plain check, the xDS dump check or
/// the diff, writing results to `out` and problems to `err`.
pub fn run(args: &CheckArgs, out: &mut impl Write, err: &mut impl Write) -> Checked {
    let load = crate::config::compile::LoadOptions {
        merge_domains: args.merge_domain_config,
        default_algorithm: args.default_algorithm.unwrap_or_default(),
    };
    if let Some(old) = &args.diff {
        let given = args.default_algorithm.is_some();
        return Checked::Diff(super::diff::run(old, &args.paths, load, given, out, err));
    }
    let check = if args.xds_resources {
        check_xds_dumps
    } else {
        check_config
    };
    if check(&args.paths, load, out, err) {
        Checked::Valid
    } else {
        Checked::Invalid
    }
}

/// `check-config --xds-resources`: reads each of `paths` as a YAML dump of
/// `RateLimitConfig` resources and compiles it as one pushed set would be
/// (the xDS source's mapping and validation), writing one `OK` line per valid
/// dump to `out` and every problem of the others to `err`.
///
/// Returns whether every dump is valid.
pub fn check_xds_dumps(
    paths: &[PathBuf],
    load: crate::config::compile::LoadOptions,
    out: &mut impl Write,
    err: &mut impl Write,
) -> bool {
    use crate::config::source::xds::resources::{compile_configs, parse_dump};
    let mut ok = true;
    for p in paths {
        let name = p.display().to_string();
        let result = crate::config::files::read_file(p)
            .map_err(|message| {
                crate::config::ConfigErrors(vec![crate::config::ConfigError {
                    file: name.clone(),
                    line: None,
                    path: String::new(),
                    message,
                }])
            })
            .and_then(|bytes| {
                String::from_utf8(bytes).map_err(|_| {
                    crate::config::ConfigErrors(vec![crate::config::ConfigError {
                        file: name.clone(),
                        line: None,
                        path: String::new(),
                        message: "not valid UTF-8".into(),
                    }])
                })
            })
            .and_then(|text| parse_dump(&name, &text))
            .and_then(|configs| compile_configs(&configs, load).map(|c| (configs.len(), c)));
        match result {
            Ok((n, c)) => {
                let _ = writeln!(
                    out,
                    "{name}: OK ({n} resources, {} domains, {} rules, sha256 {})",
                    c.domains.len(),
                    c.rule_count(),
                    c.hash
                );
            }
            Err(errs) => {
                ok = false;
                for e in errs.0 {
                    let _ = writeln!(err, "{e}");
                }
            }
        }
    }
    ok
}

/// `check-config`: loads each of `paths` as one config source with the
/// service's loader, writes one `OK` line per valid source to `out` and every
/// problem of the others to `err`. A failed write is ignored (the reader is
/// gone; the result still tells the outcome).
///
/// Returns whether every source is valid.
pub fn check_config(
    paths: &[PathBuf],
    load: crate::config::compile::LoadOptions,
    out: &mut impl Write,
    err: &mut impl Write,
) -> bool {
    let mut ok = true;
    // Domains of the sources checked so far, to catch one domain given by
    // two sources (one service loads one source: the second would be lost).
    let mut seen: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let plural = |n: usize, one: &'static str, many: &'static str| {
        format!("{n} {}", if n == 1 { one } else { many })
    };
    for p in paths {
        match crate::config::files::load_source_with(p, load) {
            Ok(c) => {
                let mut names: Vec<&String> = c.domains.keys().collect();
                names.sort();
                let mut clash = false;
                for d in names {
                    if let Some(first) = seen.get(d) {
                        clash = true;
                        let _ = writeln!(
                            err,
                            "{}: domain: duplicate domain '{d}' (also defined in {first}, given as another source; a service loads one --config source, so put both in one directory)",
                            p.display()
                        );
                    } else {
                        seen.insert(d.clone(), p.display().to_string());
                    }
                }
                if clash {
                    ok = false;
                    continue;
                }
                let _ = writeln!(
                    out,
                    "{}: OK ({}, {}, sha256 {})",
                    p.display(),
                    plural(c.domains.len(), "domain", "domains"),
                    plural(c.rule_count(), "rule", "rules"),
                    c.hash
                );
            }
            Err(errs) => {
                ok = false;
                for e in errs.0 {
                    let _ = writeln!(err, "{e}");
                }
            }
        }
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_config_refuses_one_domain_given_by_two_sources() {
        let dir = tempfile::tempdir().expect("temp dir");
        let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
        let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
        std::fs::write(&a, yaml).expect("write");
        std::fs::write(&b, yaml.replace("key: k", "key: j")).expect("write");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(!check_config(
            &[a.clone(), b],
            Default::default(),
            &mut out,
            &mut err
        ));
        let (out, err) = (
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        );
        assert!(
            out.contains("a.yaml: OK (1 domain, 1 rule, sha256 "),
            "{out}"
        );
        assert!(
            err.contains("b.yaml: domain: duplicate domain 'd' (also defined in ")
                && err.contains("a.yaml, given as another source"),
            "{err}"
        );
    }

    #[test]
    fn check_config_reports_ok_lines_and_every_problem() {
        let dir = tempfile::tempdir().expect("temp dir");
        let good = dir.path().join("good.yaml");
        std::fs::write(
            &good,
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        )
        .expect("write");
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minnute, requests_per_unit: 1}\n")
            .expect("write");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(check_config(
            std::slice::from_ref(&good),
            Default::default(),
            &mut out,
            &mut err
        ));
        let out_text = String::from_utf8(out).expect("utf-8");
        assert!(
            out_text.starts_with(&format!(
                "{}: OK (1 domain, 1 rule, sha256 ",
                good.display()
            )),
            "{out_text}"
        );
        assert!(err.is_empty());
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(!check_config(
            &[good, bad],
            Default::default(),
            &mut out,
            &mut err
        ));
        let err_text = String::from_utf8(err).expect("utf-8");
        assert!(
            err_text.contains("bad.yaml") && err_text.contains("minnute"),
            "{err_text}"
        );
        assert_eq!(String::from_utf8(out).expect("utf-8").lines().count(), 1);
    }

    #[test]
    fn check_config_reads_xds_resource_dumps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = dir.path().join("good.yaml");
        std::fs::write(
            &good,
            "name: a\ndomain: a\ndescriptors:\n  - key: k\n    value: \"\"\n    rate_limit:\n      requests_per_unit: 5\n      unit: SECOND\n---\nname: b\ndomain: b\ndescriptors: []\n",
        )
        .expect("write");
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "name: c\ndomain: c\ndescriptors:\n  - key: k\n    rate_limit:\n      requests_per_unit: 5\n").expect("write");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(check_xds_dumps(
            std::slice::from_ref(&good),
            crate::config::compile::LoadOptions::default(),
            &mut out,
            &mut err
        ));
        let out = String::from_utf8(out).expect("UTF-8");
        assert!(
            out.contains("OK (2 resources, 2 domains, 1 rules, sha256 "),
            "{out}"
        );
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert!(!check_xds_dumps(
            &[good, bad],
            crate::config::compile::LoadOptions::default(),
            &mut out,
            &mut err
        ));
        let err = String::from_utf8(err).expect("UTF-8");
        assert!(
            err.contains("c: descriptors[0](key=k).rate_limit: bad unit 'UNKNOWN'"),
            "{err}"
        );
    }
}
