//! Validates raw config trees and compiles them into a [`Config`].
//!
//! Parsing is separated from file reading: [`compile_file`] takes a file name
//! and its text, [`compile_raw_files`] takes trees already built (by the
//! YAML parser or by the xDS source), and [`super::files`] reads a file or a
//! directory. Every problem is collected (not only the first) and each names
//! the file, the line where there is one, and the descriptor path. The
//! blocks that make a descriptor's rule (`rate_limit`, `replaces`,
//! `reservation`) are validated in `compile/rule.rs`.

use super::files::hash_files;
pub use super::problem::descriptor_path;
use super::problem::{Line, nearest, source_of};
use super::scalar;
use super::schema::{self, RawDescriptor, RawFile, StrayKey, Text};
use super::{
    Config, ConfigError, ConfigErrors, DomainConfig, MetricLevel, MetricLevelKind, Policy, Rule,
};
use crate::matcher::{Level, Pattern, Selector};
use crate::metrics::RuleCounters;
use crate::storage::algorithm::AlgorithmKind;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::SystemTime;

mod rule;
use rule::{compile_rate_limit, compile_replaces, compile_reservation};

/// Most bytes one descriptor's `metadata` may take as JSON: YAML aliases
/// can make a few lines expand to megabytes, sent with every response.
pub const MAX_METADATA_BYTES: usize = 64 * 1024;

const FILE_KEYS: &[&str] = &["domain", "descriptors"];
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "rate_limit",
    "replaces",
    "shadow_mode",
    "detailed_metric",
    "share_threshold",
    "quota_mode",
    "value_to_metric",
    "metadata",
    "reservation",
    "descriptors",
];
const RESERVATION_KEYS: &[&str] = &["ttl_seconds", "max_open"];
const RATE_LIMIT_KEYS: &[&str] = &[
    "unit",
    "requests_per_unit",
    "burst",
    "max_debt",
    "algorithm",
    "name",
    "unlimited",
    "replaces",
];

struct Ctx<'a> {
    file: &'a str,
    /// The file's text (empty for a tree not parsed from a file).
    source: &'a str,
    /// The algorithm of a rule that names none (`--default-algorithm`).
    default_algorithm: AlgorithmKind,
    errors: Vec<ConfigError>,
    /// Where the file has a plain scalar that the Go service reads as a
    /// number it refuses ([`scalar::refused_plain_scalars`]), found when a
    /// text field first looks like one.
    refused_plain: Option<HashSet<usize>>,
}

impl Ctx<'_> {
    fn err(&mut self, line: impl Line, path: &str, message: impl Into<String>) {
        self.errors.push(ConfigError {
            file: self.file.to_owned(),
            line: line.line().filter(|l| *l > 0),
            path: path.to_owned(),
            message: message.into(),
        });
    }

    fn stray(&mut self, keys: &[StrayKey], path: &str, here: &[&str]) {
        for k in keys {
            let msg = if let Some(level) = [
                ("the top level", FILE_KEYS),
                ("a descriptor", DESCRIPTOR_KEYS),
                ("rate_limit", RATE_LIMIT_KEYS),
                ("reservation", RESERVATION_KEYS),
            ]
            .iter()
            .find(|(_, ks)| ks.contains(&k.name.as_str()) && !std::ptr::eq(*ks, here))
            .map(|(l, _)| *l)
            {
                format!("unknown key '{}' here: it belongs in {level}", k.name)
            } else if let Some(near) = nearest(&k.name, here) {
                format!(
                    "unknown key '{}': did you mean '{near}'? (expected one of: {})",
                    k.name,
                    here.join(", ")
                )
            } else {
                format!(
                    "unknown key '{}' (expected one of: {})",
                    k.name,
                    here.join(", ")
                )
            };
            self.err(k.line, path, msg);
        }
    }

    fn boolean(&mut self, t: Option<&Text>, path: &str, what: &str) -> bool {
        let Some(t) = t else { return false };
        scalar::read_bool(&t.value, self.quoted(t)).unwrap_or_else(|e| {
            self.err(t.line, path, format!("{what}: {e}"));
            false
        })
    }

    fn uint(&mut self, t: &Text, path: &str, what: &str) -> Option<u32> {
        scalar::read_u32(&t.value, self.quoted(t))
            .map_err(|e| self.err(t.line, path, format!("{what}: {e}")))
            .ok()
    }

    /// Checks a text field (`domain`, `key`, `value`, a rule's `name`): a
    /// plain scalar that the Go service reads as a float (`value: 1.50`) is
    /// refused, as it refuses the file. A tree not parsed from a file (an
    /// xDS push) has no scalars to check.
    fn text(&mut self, t: Option<&Text>, path: &str, what: &str) {
        let Some((t, offset)) = t.and_then(|t| Some((t, t.offset?))) else {
            return;
        };
        let Err(e) = scalar::check_plain_text(&t.value) else {
            return;
        };
        let source = self.source;
        if self
            .refused_plain
            .get_or_insert_with(|| scalar::refused_plain_scalars(source))
            .contains(&offset)
        {
            self.err(t.line, path, format!("{what}: {e}"));
        }
    }

    /// Whether `t` was written in quotes: the byte where it starts in the
    /// file's text (none for a tree not parsed from a file).
    fn quoted(&self, t: &Text) -> bool {
        t.offset
            .and_then(|o| self.source.as_bytes().get(o))
            .is_some_and(|b| matches!(b, b'"' | b'\''))
    }
}

/// Compiles one file's text into its domain, with the default
/// [`LoadOptions`].
///
/// # Errors
/// Every problem found, each naming `file`, the line and the descriptor path.
pub fn compile_file(file: &str, text: &str) -> Result<DomainConfig, Vec<ConfigError>> {
    compile_file_with(file, text, LoadOptions::default())
}

/// Compiles one file's text into its domain under `options` (a rule that
/// names no `algorithm` gets `options.default_algorithm`).
///
/// # Errors
/// Every problem found, each naming `file`, the line and the descriptor path.
pub fn compile_file_with(
    file: &str,
    text: &str,
    options: LoadOptions,
) -> Result<DomainConfig, Vec<ConfigError>> {
    let mut cx = Ctx {
        file,
        source: text,
        default_algorithm: options.default_algorithm,
        errors: Vec::new(),
        refused_plain: None,
    };
    let raw = match schema::parse(text) {
        Ok(Some(raw)) => raw,
        Ok(None) => {
            cx.err(
                0,
                "",
                "empty file: expected a mapping with 'domain' and 'descriptors'",
            );
            return Err(cx.errors);
        }
        Err(e) => {
            let mut line = e.location().map_or(0, |l| l.line());
            let mut msg = parse_error_message(&e.to_string());
            // The scanner reports where the scalar before a tab started;
            // point at the tab itself (YAML indents with spaces only).
            if msg.contains("found a tab") {
                let from = usize::try_from(line).unwrap_or(0).saturating_sub(1);
                if let Some((n, col)) = text
                    .lines()
                    .enumerate()
                    .skip(from)
                    .find_map(|(n, l)| l.find('\t').map(|c| (n, c)))
                {
                    line = u64::try_from(n + 1).unwrap_or(u64::MAX);
                    msg = format!(
                        "invalid YAML at column {}: a tab; YAML indents with spaces only",
                        col + 1
                    );
                }
            }
            cx.err(line, "", msg);
            return Err(cx.errors);
        }
    };
    let domain = compile_raw(&mut cx, raw);
    match domain {
        Some(d) if cx.errors.is_empty() => Ok(d),
        _ => Err(cx.errors),
    }
}

fn compile_raw(cx: &mut Ctx<'_>, raw: RawFile) -> Option<DomainConfig> {
    cx.stray(&raw.stray, "", FILE_KEYS);
    cx.text(raw.domain.as_ref(), "", "domain");
    let name = match &raw.domain {
        Some(d) if d.value.trim() != d.value => {
            cx.err(
                d.line,
                "domain",
                format!("domain '{}' has leading or trailing whitespace", d.value),
            );
            String::new()
        }
        Some(d) if !d.value.trim().is_empty() => d.value.clone(),
        Some(d) => {
            cx.err(d.line, "domain", "domain must not be empty");
            String::new()
        }
        None => {
            cx.err(1, "", "missing 'domain'");
            String::new()
        }
    };
    let mut out = DomainConfig {
        name: name.clone(),
        file: cx.file.to_owned(),
        rules: Vec::new(),
        root: Level::default(),
        override_counters: Arc::new(RuleCounters::new(format!("{name}._override"))),
    };
    let descs = raw.descriptors.unwrap_or_default();
    let mut root = Level::default();
    compile_level(
        cx,
        &descs,
        "descriptors",
        &name,
        &mut root,
        &mut out.rules,
        &mut Vec::new(),
    );
    out.root = root;
    // Names and replaces.
    let names: HashSet<&str> = out.rules.iter().filter_map(|r| r.name.as_deref()).collect();
    for r in &out.rules {
        for n in &r.replaces {
            if !names.contains(n.as_str()) {
                tracing::debug!(rule = %r.path, replaced = %n, "replaces names no rule of this domain");
            }
        }
    }
    Some(out)
}

/// Turns the YAML parser's message into one line for an operator: the column
/// stays, the line is already in the error's location, library hints go, and a
/// value of the wrong shape says so (it stops the parse, so only this problem
/// of the file is reported until it is fixed).
fn parse_error_message(msg: &str) -> String {
    let first = msg.lines().next().unwrap_or("invalid YAML");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    let (column, rest) = match first.strip_prefix("line ").and_then(|r| r.split_once(": ")) {
        Some((pos, rest)) => (
            pos.split_once(" column ")
                .map(|(_, c)| format!(" at column {c}"))
                .unwrap_or_default(),
            rest,
        ),
        None => (String::new(), first),
    };
    let shape = |what: &str| {
        format!(
            "wrong type{column}: expected {what}; fix this first (the rest of the file is checked once it parses)"
        )
    };
    match rest {
        "expected string scalar" => {
            shape("a single value (text or number), found a list or mapping")
        }
        "expected sequence start" => shape("a list (`- ...` entries)"),
        "expected mapping start" => shape("a mapping (`key: value` lines)"),
        r if r.starts_with("duplicate mapping key: ") => {
            let key = r.trim_start_matches("duplicate mapping key: ");
            let key = key.split(", set DuplicateKeyPolicy").next().unwrap_or(key);
            format!("duplicate key '{key}' in one mapping{column}")
        }
        // The parser's nesting budget (a guard against stack exhaustion):
        // about 30 descriptor levels, each two YAML levels deep.
        r if r.starts_with("budget breached: Depth") => format!(
            "nested too deeply{column}: descriptors may nest about 30 levels (the YAML parser's depth limit, which protects the service's stack)"
        ),
        r if r.starts_with("multiple YAML documents") => {
            format!("more than one YAML document (`---`){column}: put one domain per file")
        }
        r => format!("invalid YAML{column}: {r}"),
    }
}

fn selector_text(key: &str, value: Option<&str>) -> String {
    match value {
        Some(v) => format!("{key}_{v}"),
        None => key.to_owned(),
    }
}

fn compile_level(
    cx: &mut Ctx<'_>,
    descs: &[RawDescriptor],
    path: &str,
    rule_prefix: &str,
    level: &mut Level,
    rules: &mut Vec<Rule>,
    chain: &mut Vec<MetricLevel>,
) {
    let mut siblings: HashMap<(String, Option<String>), (Option<u32>, String)> = HashMap::new();
    for (i, d) in descs.iter().enumerate() {
        let here = descriptor_path(
            path,
            i,
            d.key.as_ref().map(|k| k.value.as_str()),
            d.value.as_ref().map(|v| v.value.as_str()),
        );
        cx.stray(&d.stray, &here, DESCRIPTOR_KEYS);
        cx.text(d.key.as_ref(), &here, "key");
        cx.text(d.value.as_ref(), &here, "value");
        let Some(key) = d.key.as_ref().filter(|k| !k.value.is_empty()) else {
            cx.err(d.line, &here, "descriptor without 'key'");
            continue;
        };
        let empty_value = d.null_value.or_else(|| {
            d.value
                .as_ref()
                .filter(|v| v.value.is_empty())
                .map(|v| v.line)
        });
        // A descriptor with an empty value is an error, but the rest of it is
        // still checked (into a tree that is thrown away), so one mistake
        // does not hide the others.
        let (mut scratch_level, mut scratch_rules) = (Level::default(), Vec::new());
        let (level, rules): (&mut Level, &mut Vec<Rule>) = if let Some(line) = empty_value {
            cx.err(
                line,
                &here,
                "'value' is empty or null: leave 'value' out for one bucket per value (envoyproxy/ratelimit reads an empty value that way), or quote a literal such as value: \"~\"",
            );
            (&mut scratch_level, &mut scratch_rules)
        } else {
            (&mut *level, &mut *rules)
        };
        let value = d
            .value
            .as_ref()
            .map(|v| v.value.clone())
            .filter(|_| empty_value.is_none());
        let composite = format!(
            "{rule_prefix}.{}",
            selector_text(&key.value, value.as_deref())
        );
        if empty_value.is_none()
            && let Some((first_line, first_path)) =
                siblings.insert((key.value.clone(), value.clone()), (d.line, here.clone()))
        {
            let first = match first_line {
                Some(l) => format!("on line {l}"),
                None => format!("at {first_path}"),
            };
            cx.err(
                d.line,
                &here,
                format!("duplicate descriptor composite key '{composite}' (first defined {first}); give each key/value one entry"),
            );
            continue;
        }
        let share_threshold = cx.boolean(d.share_threshold.as_ref(), &here, "share_threshold");
        let is_wild = value.as_deref().is_some_and(|v| v.contains('*'));
        if share_threshold && !is_wild {
            cx.err(
                d.line,
                &here,
                "share_threshold needs a wildcard value (one containing '*')",
            );
        }
        let shadow_mode = cx.boolean(d.shadow_mode.as_ref(), &here, "shadow_mode");
        let detailed_metric = cx.boolean(d.detailed_metric.as_ref(), &here, "detailed_metric");
        let quota_mode = cx.boolean(d.quota_mode.as_ref(), &here, "quota_mode");
        let value_to_metric = cx.boolean(d.value_to_metric.as_ref(), &here, "value_to_metric");
        let metadata = match &d.metadata {
            None | Some((_, serde_json::Value::Null)) => None,
            Some((_, serde_json::Value::Object(m))) if m.is_empty() => None,
            Some((line, serde_json::Value::Object(m)))
                if serde_json::to_vec(m).map_or(usize::MAX, |v| v.len()) > MAX_METADATA_BYTES =>
            {
                cx.err(
                    *line,
                    &here,
                    format!(
                        "metadata is larger than {MAX_METADATA_BYTES} bytes as JSON (it is sent with every response that carries it)"
                    ),
                );
                None
            }
            Some((_, serde_json::Value::Object(m))) => Some(Arc::new(m.clone())),
            Some((line, other)) => {
                cx.err(
                    *line,
                    &here,
                    format!(
                        "metadata must be a mapping (it becomes a protobuf Struct), got {}",
                        json_kind(other)
                    ),
                );
                None
            }
        };
        chain.push(MetricLevel {
            key: key.value.clone(),
            kind: match &value {
                None => MetricLevelKind::KeyOnly,
                Some(v) if is_wild => MetricLevelKind::Wildcard {
                    pattern: v.clone(),
                    share_threshold,
                },
                Some(v) => MetricLevelKind::Exact(v.clone()),
            },
            value_to_metric,
        });
        let sel = match &value {
            None => Selector::KeyOnly,
            Some(v) if is_wild => Selector::Wildcard(Pattern::new(v)),
            Some(v) => Selector::Exact(v.clone()),
        };
        let node = level.insert(&key.value, sel);
        node.share_threshold = share_threshold;
        node.source = source_of(cx.file, d.line);
        let mut replaces = Vec::new();
        if let Some(r) = &d.replaces {
            replaces.extend(compile_replaces(cx, r, &format!("{here}.replaces")));
        }
        if let Some(rl) = &d.rate_limit {
            let rl_path = format!("{here}.rate_limit");
            if let Some(r) = &rl.replaces {
                if d.replaces.is_some() {
                    cx.err(
                        rl.line,
                        &rl_path,
                        "'replaces' given both on the descriptor and in rate_limit; use one",
                    );
                }
                replaces.extend(compile_replaces(cx, r, &format!("{rl_path}.replaces")));
            }
            let reservation = d.reservation.as_ref().and_then(|r| {
                compile_reservation(
                    cx,
                    r,
                    &format!("{here}.reservation"),
                    value.is_some(),
                    d.descriptors.as_ref().is_some_and(|c| !c.is_empty()),
                )
            });
            if let Some((policy, name)) = compile_rate_limit(cx, rl, &rl_path) {
                if reservation.is_some() {
                    let res_line = d.reservation.as_ref().and_then(|r| r.line);
                    match policy {
                        Policy::Limited {
                            algorithm: AlgorithmKind::TokenBucket,
                            ..
                        } => {}
                        Policy::Limited { algorithm, .. } => cx.err(
                            res_line,
                            &format!("{here}.reservation"),
                            format!("a reservation needs a token bucket rule, and this rule is a {algorithm} (add 'algorithm: token_bucket' to its rate_limit)"),
                        ),
                        Policy::Unlimited => cx.err(
                            res_line,
                            &format!("{here}.reservation"),
                            "a reservation needs a token bucket rule, and this rule is 'unlimited: true' (it has no bucket to reserve from)",
                        ),
                    }
                }
                if let Some(n) = &name
                    && replaces.iter().any(|r| r == n)
                {
                    cx.err(rl.line, &rl_path, format!("rule '{n}' replaces itself"));
                }
                node.rule = Some(rules.len());
                rules.push(Rule {
                    path: composite.clone(),
                    name,
                    policy,
                    replaces,
                    shadow_mode,
                    detailed_metric,
                    quota_mode,
                    metadata,
                    metric_levels: chain
                        .iter()
                        .any(|l| l.value_to_metric)
                        .then(|| chain.clone()),
                    levels: chain.clone().into(),
                    reservation,
                    source: source_of(cx.file, d.line),
                    counters: Arc::new(RuleCounters::new(composite.clone())),
                });
            }
        } else if !replaces.is_empty() {
            cx.err(
                d.line,
                &here,
                "'replaces' needs a rate_limit on the same descriptor",
            );
        }
        if d.rate_limit.is_none()
            && let Some(r) = &d.reservation
        {
            cx.err(
                r.line,
                &format!("{here}.reservation"),
                "a reservation needs a rate_limit on the same descriptor (the token bucket it reserves from)",
            );
        }
        if let Some(children) = &d.descriptors {
            compile_level(
                cx,
                children,
                &format!("{here}.descriptors"),
                &composite,
                &mut node.children,
                rules,
                chain,
            );
        }
        chain.pop();
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "a mapping",
    }
}

/// Adds the rules of `other` (a second file of the same domain) to `into`.
/// Returns one error per top-level descriptor both define, naming both
/// places.
fn merge_domain(into: &mut DomainConfig, other: DomainConfig) -> Vec<ConfigError> {
    let offset = into.rules.len();
    let duplicates = into.root.merge(other.root, offset);
    into.rules.extend(other.rules);
    if !into.file.split(", ").any(|f| f == other.file) {
        into.file = format!("{}, {}", into.file, other.file);
    }
    duplicates
        .into_iter()
        .map(|(selector, first, second)| {
            // `file:line`, or a bare label for a tree without lines.
            let (file, line) = match second.rsplit_once(':') {
                Some((f, l)) if l.parse::<u32>().is_ok() => (f, l.parse().ok()),
                _ => (second.as_str(), None),
            };
            ConfigError {
                file: file.to_owned(),
                line,
                path: "descriptors".into(),
                message: format!(
                    "duplicate descriptor composite key '{}.{selector}' (first defined at {first}); with merged domains each top-level key/value may be defined in one file only",
                    into.name
                ),
            }
        })
        .collect()
}

/// How files become one config.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Files that define the same domain are merged into one domain
    /// (`--merge-domain-config`, the Go service's `MERGE_DOMAIN_CONFIG`); a
    /// top-level descriptor defined in two of them is still an error. Off: a
    /// second file for a domain is an error.
    pub merge_domains: bool,
    /// The algorithm of every rule that names none in `rate_limit.algorithm`
    /// (`--default-algorithm`; a config pushed over xDS can name none).
    pub default_algorithm: AlgorithmKind,
}

/// Compiles already-read files `(name, bytes)` into a [`Config`].
///
/// # Errors
/// Every problem of every file (invalid UTF-8 included), plus duplicate domains.
pub fn compile_texts(texts: &[(String, Vec<u8>)]) -> Result<Config, ConfigErrors> {
    compile_texts_with(texts, LoadOptions::default())
}

/// [`compile_texts`] with `options`.
///
/// # Errors
/// As [`compile_texts`]; with `merge_domains`, a top-level descriptor defined
/// in two files of one domain instead of a duplicate domain.
pub fn compile_texts_with(
    texts: &[(String, Vec<u8>)],
    options: LoadOptions,
) -> Result<Config, ConfigErrors> {
    let mut errors = Vec::new();
    let mut domains = Vec::with_capacity(texts.len());
    for (name, bytes) in texts {
        let text = match std::str::from_utf8(bytes) {
            Ok(t) => t,
            Err(e) => {
                let line = bytes[..e.valid_up_to()]
                    .iter()
                    .filter(|b| **b == b'\n')
                    .count()
                    + 1;
                errors.push(ConfigError {
                    file: name.clone(),
                    line: u32::try_from(line).ok(),
                    path: String::new(),
                    message: format!(
                        "not valid UTF-8 (invalid byte at offset {})",
                        e.valid_up_to()
                    ),
                });
                continue;
            }
        };
        domains.push((name.as_str(), compile_file_with(name, text, options)));
    }
    assemble(domains, errors, options, || hash_files(texts))
}

/// Compiles trees already built, `(name, tree)` (xDS resources mapped onto
/// the schema), into a [`Config`] whose hash is `hash`, with the checks a
/// file gets. Errors carry the lines the trees have (none for xDS).
///
/// # Errors
/// Every problem of every tree, plus duplicate domains (with
/// `merge_domains`, a top-level descriptor defined twice in one domain).
pub fn compile_raw_files(
    files: Vec<(String, RawFile)>,
    hash: String,
    options: LoadOptions,
) -> Result<Config, ConfigErrors> {
    let (names, results): (Vec<String>, Vec<_>) = files
        .into_iter()
        .map(|(name, raw)| {
            let mut cx = Ctx {
                file: &name,
                source: "",
                default_algorithm: options.default_algorithm,
                errors: Vec::new(),
                refused_plain: None,
            };
            let d = compile_raw(&mut cx, raw);
            let result = match d {
                Some(d) if cx.errors.is_empty() => Ok(d),
                _ => Err(cx.errors),
            };
            (name, result)
        })
        .unzip();
    assemble(
        names.iter().map(String::as_str).zip(results).collect(),
        Vec::new(),
        options,
        || hash,
    )
}

/// The domains of compiled files as one [`Config`]: merged or refused as
/// duplicates per `options`; `errors` are problems found before.
fn assemble(
    files: Vec<(&str, Result<DomainConfig, Vec<ConfigError>>)>,
    mut errors: Vec<ConfigError>,
    options: LoadOptions,
    hash: impl FnOnce() -> String,
) -> Result<Config, ConfigErrors> {
    let mut domains: HashMap<String, Arc<DomainConfig>> = HashMap::new();
    for (name, result) in files {
        match result {
            Ok(d) => {
                if options.merge_domains
                    && let Some(prev) = domains.get_mut(&d.name)
                {
                    errors.extend(merge_domain(Arc::make_mut(prev), d));
                } else if let Some(prev) = domains.get(&d.name) {
                    errors.push(ConfigError {
                        file: name.to_owned(),
                        line: None,
                        path: "domain".into(),
                        message: format!(
                            "duplicate domain '{}' (also defined in {}; --merge-domain-config merges the files of one domain)",
                            d.name, prev.file
                        ),
                    });
                } else {
                    domains.insert(d.name.clone(), Arc::new(d));
                }
            }
            Err(mut e) => errors.append(&mut e),
        }
    }
    if errors.is_empty() {
        Ok(Config {
            domains,
            hash: hash(),
            loaded_at: SystemTime::now(),
        })
    } else {
        Err(ConfigErrors(errors))
    }
}
