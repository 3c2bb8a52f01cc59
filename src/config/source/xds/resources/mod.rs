//! `RateLimitConfig` resources (package `ratelimit.config.ratelimit.v3`)
//! compiled into the same [`Config`] the file loader builds.
//!
//! Each resource is mapped onto the schema tree a YAML file parses into
//! ([`RawFile`]), and the whole set goes through [`compile_raw_files`], so a
//! pushed config is validated by exactly the rules a file is (the Go service
//! does the same: its `ConfigXdsProtoToYaml` maps the proto onto the structs
//! its file loader reads). The proto has no presence for scalars, so its
//! defaults mean "absent": an empty `value` is a key-only entry, an unset
//! `rate_limit` is no rule, an empty `name` is no name, unit `UNKNOWN` is no
//! unit (an error unless `unlimited`).
//!
//! Errors name the resource (its `name`, else `resources[i]`) and the
//! descriptor path with each level's key and value
//! (`descriptors[0](key=tenant, value=t1).descriptors[1](key=path).rate_limit`,
//! [`descriptor_path`]); they carry no line, since the tree has none.

use crate::config::compile::{LoadOptions, compile_raw_files, descriptor_path};
use crate::config::schema::{RawDescriptor, RawFile, RawRateLimit, RawReplace, Text};
use crate::config::{Config, ConfigError, ConfigErrors};
use envoy_types::pb::google::protobuf::{Any, Struct, Value as PbValue, value::Kind};
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitReplace, RateLimitUnit,
};
use prost::Message as _;
use sha2::{Digest, Sha256};

/// Type URL of the one resource type on the stream.
pub const RATE_LIMIT_CONFIG_TYPE_URL: &str =
    "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// Longest resource label (its `name`, or its domain) kept in errors, logs and
/// `/rlconfig`, in bytes; longer ones are cut with `...`.
pub const MAX_LABEL_BYTES: usize = 256;

/// Compiles one pushed set of resources (every `Any` of a
/// `DiscoveryResponse`) into a [`Config`], validated as files are.
///
/// The config's hash is SHA-256 over the mapped resources in label order,
/// so every replica that receives the same set computes the same hash,
/// whatever the order of the resources in the response.
///
/// # Errors
/// Every problem of the set: a resource of another type URL, one that does
/// not decode, and every loader error (empty or duplicate domain, empty key,
/// duplicate composite key, a unit missing or given with `unlimited`, bad
/// `replaces`, metadata that cannot be a `Struct`). One bad resource refuses
/// the whole set.
pub fn compile_resources(resources: &[Any], load: LoadOptions) -> Result<Config, ConfigErrors> {
    let mut errors = Vec::new();
    let mut configs = Vec::with_capacity(resources.len());
    for (i, any) in resources.iter().enumerate() {
        let at = format!("resources[{i}]");
        if any.type_url != RATE_LIMIT_CONFIG_TYPE_URL {
            errors.push(err(
                &at,
                "",
                format!(
                    "type URL '{}' is not {RATE_LIMIT_CONFIG_TYPE_URL}",
                    bounded(&any.type_url)
                ),
            ));
            continue;
        }
        match RateLimitConfig::decode(any.value.as_slice()) {
            Ok(c) => configs.push((i, c)),
            Err(e) => errors.push(err(
                &at,
                "",
                format!("does not decode as RateLimitConfig: {e}"),
            )),
        }
    }
    compile_mapped(configs.iter().map(|(i, c)| (*i, c)), errors, load)
}

/// Compiles decoded resources (a YAML dump read by [`parse_dump`]) as
/// [`compile_resources`] does.
///
/// # Errors
/// As [`compile_resources`], without the type URL and decoding checks.
pub fn compile_configs(
    configs: &[RateLimitConfig],
    load: LoadOptions,
) -> Result<Config, ConfigErrors> {
    compile_mapped(configs.iter().enumerate(), Vec::new(), load)
}

/// Maps each `(index, resource)` onto a schema tree (its problems added to
/// `errors`) and compiles the set, sorted by label, with its hash.
fn compile_mapped<'a>(
    configs: impl ExactSizeIterator<Item = (usize, &'a RateLimitConfig)>,
    mut errors: Vec<ConfigError>,
    load: LoadOptions,
) -> Result<Config, ConfigErrors> {
    let mut files = Vec::with_capacity(configs.len());
    for (i, c) in configs {
        let label = label(i, c);
        match map_config(c) {
            Ok(raw) => files.push((label, raw)),
            Err(e) => errors.extend(
                e.into_iter()
                    .map(|(path, message)| err(&label, &path, message)),
            ),
        }
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    let hash = hash_mapped(&files);
    match compile_raw_files(files, hash, load) {
        Ok(config) if errors.is_empty() => Ok(config),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(ConfigErrors(more)) => {
            errors.extend(more);
            Err(ConfigErrors(errors))
        }
    }
}

/// SHA-256 (hex) over `(label, tree)` pairs, already sorted by label: every
/// field of each tree in a fixed order, each string length-prefixed, so
/// equal sets hash equal whatever the order of the resources.
fn hash_mapped(files: &[(String, RawFile)]) -> String {
    fn text(h: &mut Sha256, tag: u8, t: Option<&Text>) {
        h.update([tag]);
        match t {
            Some(t) => {
                h.update((t.value.len() as u64).to_be_bytes());
                h.update(t.value.as_bytes());
            }
            None => h.update(u64::MAX.to_be_bytes()),
        }
    }
    fn descriptors(h: &mut Sha256, list: Option<&Vec<RawDescriptor>>) {
        let list = list.map_or(&[][..], Vec::as_slice);
        h.update((list.len() as u64).to_be_bytes());
        for d in list {
            text(h, b'k', d.key.as_ref());
            text(h, b'v', d.value.as_ref());
            text(h, b's', d.shadow_mode.as_ref());
            text(h, b'd', d.detailed_metric.as_ref());
            text(h, b'q', d.quota_mode.as_ref());
            let meta = d.metadata.as_ref().map(|(_, m)| Text::new(m.to_string()));
            text(h, b'm', meta.as_ref());
            match d.rate_limit.as_deref() {
                None => h.update([0]),
                Some(rl) => {
                    h.update([1]);
                    text(h, b'u', rl.unit.as_ref());
                    text(h, b'r', rl.requests_per_unit.as_ref());
                    text(h, b'l', rl.unlimited.as_ref());
                    text(h, b'n', rl.name.as_ref());
                    let replaces = rl.replaces.as_deref().unwrap_or_default();
                    h.update((replaces.len() as u64).to_be_bytes());
                    for r in replaces {
                        text(h, b'p', r.name.as_ref());
                    }
                }
            }
            descriptors(h, d.descriptors.as_ref());
        }
    }
    let mut h = Sha256::new();
    h.update(b"xds\0");
    for (label, raw) in files {
        h.update((label.len() as u64).to_be_bytes());
        h.update(label.as_bytes());
        text(&mut h, b'D', raw.domain.as_ref());
        descriptors(&mut h, raw.descriptors.as_ref());
    }
    hex::encode(h.finalize())
}

fn err(file: &str, path: &str, message: String) -> ConfigError {
    ConfigError {
        file: file.to_owned(),
        line: None,
        path: path.to_owned(),
        message,
    }
}

/// `s`, cut to [`MAX_LABEL_BYTES`] on a character boundary.
fn bounded(s: &str) -> String {
    super::cut(s, MAX_LABEL_BYTES)
}

/// The resource's name in errors and `/rlconfig`: `name`, else `domain`, else
/// `resources[i]`. Envoy Gateway sets `name` = `domain`.
fn label(i: usize, c: &RateLimitConfig) -> String {
    if !c.name.is_empty() {
        bounded(&c.name)
    } else if !c.domain.is_empty() {
        bounded(&c.domain)
    } else {
        format!("resources[{i}]")
    }
}

type MapErrors = Vec<(String, String)>;

/// Descriptors may nest this deep in a pushed config: as deep as in a file,
/// where the YAML parser's depth limit (which protects the stack) stops
/// them.
pub const MAX_DESCRIPTOR_DEPTH: usize = 31;

/// The schema tree one resource stands for (what its YAML file would parse
/// into), or the problems that keep it from being one.
fn map_config(c: &RateLimitConfig) -> Result<RawFile, MapErrors> {
    let mut errors = Vec::new();
    let descriptors = (!c.descriptors.is_empty())
        .then(|| map_descriptors(&mut errors, &c.descriptors, 1, "descriptors"));
    if errors.is_empty() {
        Ok(RawFile {
            domain: Some(Text::new(c.domain.clone())),
            descriptors,
            stray: Vec::new(),
        })
    } else {
        Err(errors)
    }
}

fn flag(on: bool) -> Option<Text> {
    on.then(|| Text::new("true"))
}

fn map_descriptors(
    errors: &mut MapErrors,
    descs: &[RateLimitDescriptor],
    depth: usize,
    path: &str,
) -> Vec<RawDescriptor> {
    let mut out = Vec::with_capacity(descs.len());
    for (i, d) in descs.iter().enumerate() {
        // As the compiler names it: the proto's empty value is a key-only
        // entry.
        let here = descriptor_path(
            path,
            i,
            Some(&d.key),
            (!d.value.is_empty()).then_some(d.value.as_str()),
        );
        let metadata = match d.metadata.as_ref().map(struct_json) {
            None => None,
            Some(Ok(json)) if json.is_empty() => None,
            Some(Ok(json)) => Some((None, serde_json::Value::Object(json))),
            Some(Err(e)) => {
                errors.push((format!("{here}.metadata"), e));
                None
            }
        };
        let descriptors = if d.descriptors.is_empty() {
            None
        } else if depth >= MAX_DESCRIPTOR_DEPTH {
            errors.push((
                format!("{here}.descriptors"),
                format!(
                    "nested too deeply: descriptors may nest at most {MAX_DESCRIPTOR_DEPTH} levels"
                ),
            ));
            None
        } else {
            Some(map_descriptors(
                errors,
                &d.descriptors,
                depth + 1,
                &format!("{here}.descriptors"),
            ))
        };
        out.push(RawDescriptor {
            key: Some(Text::new(d.key.clone())),
            value: (!d.value.is_empty()).then(|| Text::new(d.value.clone())),
            shadow_mode: flag(d.shadow_mode),
            detailed_metric: flag(d.detailed_metric),
            quota_mode: flag(d.quota_mode),
            metadata,
            rate_limit: d.rate_limit.as_ref().map(|rl| Box::new(map_policy(rl))),
            descriptors,
            ..RawDescriptor::default()
        });
    }
    out
}

fn map_policy(rl: &RateLimitPolicy) -> RawRateLimit {
    let rate = Some(Text::new(rl.requests_per_unit.to_string()));
    let unit = match RateLimitUnit::try_from(rl.unit) {
        // UNKNOWN is "no unit": fine with `unlimited`, an error without it.
        Ok(RateLimitUnit::Unknown) if rl.unlimited => None,
        Ok(unit) => Some(Text::new(unit.as_str_name())),
        Err(_) => Some(Text::new(format!("enum value {}", rl.unit))),
    };
    RawRateLimit {
        unit,
        // The Go service accepts (and ignores) a rate beside `unlimited`.
        requests_per_unit: if rl.unlimited && rl.requests_per_unit == 0 {
            None
        } else {
            rate
        },
        unlimited: flag(rl.unlimited),
        name: (!rl.name.is_empty()).then(|| Text::new(rl.name.clone())),
        replaces: (!rl.replaces.is_empty()).then(|| {
            rl.replaces
                .iter()
                .map(|RateLimitReplace { name }| RawReplace {
                    name: Some(Text::new(name.clone())),
                    ..RawReplace::default()
                })
                .collect()
        }),
        ..RawRateLimit::default()
    }
}

/// A protobuf `Struct` as a JSON object.
///
/// # Errors
/// A number that JSON cannot hold (NaN, infinity), or a value without a kind.
fn struct_json(s: &Struct) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    s.fields
        .iter()
        .map(|(k, v)| Ok((k.clone(), value_json(v)?)))
        .collect()
}

fn value_json(v: &PbValue) -> Result<serde_json::Value, String> {
    use serde_json::Value as J;
    Ok(match &v.kind {
        None | Some(Kind::NullValue(_)) => J::Null,
        Some(Kind::BoolValue(b)) => J::Bool(*b),
        Some(Kind::NumberValue(n)) => J::Number(
            serde_json::Number::from_f64(*n)
                .ok_or_else(|| format!("number {n} cannot be a protobuf Struct value"))?,
        ),
        Some(Kind::StringValue(s)) => J::String(s.clone()),
        Some(Kind::ListValue(l)) => {
            J::Array(l.values.iter().map(value_json).collect::<Result<_, _>>()?)
        }
        Some(Kind::StructValue(s)) => J::Object(struct_json(s)?),
    })
}

/// Reads a dump of `RateLimitConfig` resources: YAML documents separated by
/// `---`, each `{name, domain, descriptors}` in the protojson-like shape that
/// Envoy Gateway's translator tests write (`value: ""` for key-only entries,
/// `rate_limit: null`, `unit: SECOND` or its enum number, `replaces: []`, and
/// `value_to_metric` / `share_threshold`, which the proto lacks, only as
/// `false`).
///
/// # Errors
/// Invalid YAML, or a field of the wrong shape, named by document and path.
pub fn parse_dump(file: &str, text: &str) -> Result<Vec<RateLimitConfig>, ConfigErrors> {
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(text).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            file: file.to_owned(),
            line: e.location().and_then(|l| u32::try_from(l.line()).ok()),
            path: String::new(),
            message: format!(
                "invalid YAML: {}",
                e.to_string().lines().next().unwrap_or("")
            ),
        }])
    })?;
    let mut errors = Vec::new();
    let mut out = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        if doc.is_null() {
            continue;
        }
        let mut cx = DumpCx {
            file: format!("{file}[document {i}]"),
            errors: &mut errors,
        };
        if let Some(c) = cx.config(doc) {
            out.push(c);
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(ConfigErrors(errors))
    }
}

struct DumpCx<'a> {
    file: String,
    errors: &'a mut Vec<ConfigError>,
}

type JsonMap = serde_json::Map<String, serde_json::Value>;

impl DumpCx<'_> {
    fn fail(&mut self, path: &str, message: impl Into<String>) {
        self.errors.push(err(&self.file, path, message.into()));
    }

    fn object<'v>(&mut self, v: &'v serde_json::Value, path: &str) -> Option<&'v JsonMap> {
        match v {
            serde_json::Value::Object(m) => Some(m),
            _ => {
                self.fail(path, "expected a mapping");
                None
            }
        }
    }

    fn check_keys(&mut self, m: &JsonMap, path: &str, allowed: &[&str]) {
        for k in m.keys() {
            if !allowed.contains(&k.as_str()) {
                self.fail(
                    path,
                    format!(
                        "unknown field '{k}' (expected one of: {})",
                        allowed.join(", ")
                    ),
                );
            }
        }
    }

    fn string(&mut self, m: &JsonMap, key: &str, path: &str) -> String {
        match m.get(key) {
            None | Some(serde_json::Value::Null) => String::new(),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            Some(serde_json::Value::Bool(b)) => b.to_string(),
            Some(_) => {
                self.fail(path, format!("{key}: expected a string"));
                String::new()
            }
        }
    }

    fn boolean(&mut self, m: &JsonMap, key: &str, path: &str) -> bool {
        match m.get(key) {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(_) => {
                self.fail(path, format!("{key}: expected true or false"));
                false
            }
        }
    }

    fn list<'v>(&mut self, m: &'v JsonMap, key: &str, path: &str) -> &'v [serde_json::Value] {
        match m.get(key) {
            None | Some(serde_json::Value::Null) => &[],
            Some(serde_json::Value::Array(a)) => a,
            Some(_) => {
                self.fail(path, format!("{key}: expected a list"));
                &[]
            }
        }
    }

    fn config(&mut self, doc: &serde_json::Value) -> Option<RateLimitConfig> {
        let m = self.object(doc, "")?;
        self.check_keys(m, "", &["name", "domain", "descriptors"]);
        let name = self.string(m, "name", "");
        let domain = self.string(m, "domain", "");
        let descriptors = self.descriptors(m, "descriptors");
        Some(RateLimitConfig {
            name,
            domain,
            descriptors,
        })
    }

    fn descriptors(&mut self, m: &JsonMap, path: &str) -> Vec<RateLimitDescriptor> {
        let list = self.list(m, "descriptors", path);
        let mut out = Vec::with_capacity(list.len());
        for (i, d) in list.iter().enumerate() {
            // Named by its key and value where they are text, as the
            // compiler names a descriptor.
            let text = |field: &str| {
                d.get(field)
                    .and_then(serde_json::Value::as_str)
                    .filter(|s| field == "key" || !s.is_empty())
            };
            let here = descriptor_path(path, i, text("key"), text("value"));
            if let Some(d) = self.descriptor(d, &here) {
                out.push(d);
            }
        }
        out
    }

    fn descriptor(&mut self, v: &serde_json::Value, path: &str) -> Option<RateLimitDescriptor> {
        let m = self.object(v, path)?;
        self.check_keys(
            m,
            path,
            &[
                "key",
                "value",
                "rate_limit",
                "descriptors",
                "shadow_mode",
                "detailed_metric",
                "quota_mode",
                "metadata",
                "value_to_metric",
                "share_threshold",
            ],
        );
        for absent in ["value_to_metric", "share_threshold"] {
            if self.boolean(m, absent, path) {
                self.fail(
                    path,
                    format!("{absent}: true cannot be sent over xDS (RateLimitDescriptor has no such field)"),
                );
            }
        }
        let metadata = match m.get("metadata") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Object(o)) => Some(json_struct(o)),
            Some(_) => {
                self.fail(
                    path,
                    "metadata: expected a mapping (it is a protobuf Struct)",
                );
                None
            }
        };
        let rate_limit = match m.get("rate_limit") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => self.policy(v, &format!("{path}.rate_limit")),
        };
        Some(RateLimitDescriptor {
            key: self.string(m, "key", path),
            value: self.string(m, "value", path),
            rate_limit,
            descriptors: self.descriptors(m, &format!("{path}.descriptors")),
            shadow_mode: self.boolean(m, "shadow_mode", path),
            detailed_metric: self.boolean(m, "detailed_metric", path),
            quota_mode: self.boolean(m, "quota_mode", path),
            metadata,
        })
    }

    fn policy(&mut self, v: &serde_json::Value, path: &str) -> Option<RateLimitPolicy> {
        let m = self.object(v, path)?;
        self.check_keys(
            m,
            path,
            &["unit", "requests_per_unit", "unlimited", "name", "replaces"],
        );
        let unit = match m.get("unit") {
            None | Some(serde_json::Value::Null) => 0,
            Some(serde_json::Value::String(s)) => {
                match RateLimitUnit::from_str_name(&s.to_ascii_uppercase()) {
                    Some(u) => u as i32,
                    None => {
                        self.fail(path, format!("unit: unknown unit '{s}' (SECOND, MINUTE, HOUR, DAY, WEEK, MONTH or YEAR)"));
                        0
                    }
                }
            }
            Some(serde_json::Value::Number(n)) => {
                match n.as_i64().and_then(|n| i32::try_from(n).ok()) {
                    Some(u) => u,
                    None => {
                        self.fail(path, format!("unit: {n} is not an enum number"));
                        0
                    }
                }
            }
            Some(_) => {
                self.fail(path, "unit: expected a unit name or number");
                0
            }
        };
        let requests_per_unit = match m.get("requests_per_unit") {
            None | Some(serde_json::Value::Null) => 0,
            Some(serde_json::Value::Number(n)) => {
                match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
                    Some(r) => r,
                    None => {
                        self.fail(
                            path,
                            format!("requests_per_unit: {n} is not from 0 to 4294967295"),
                        );
                        0
                    }
                }
            }
            Some(_) => {
                self.fail(path, "requests_per_unit: expected a number");
                0
            }
        };
        let mut replaces = Vec::new();
        let rp = format!("{path}.replaces");
        for (i, r) in self.list(m, "replaces", path).iter().enumerate() {
            let here = format!("{rp}[{i}]");
            if let Some(o) = self.object(r, &here) {
                self.check_keys(o, &here, &["name"]);
                replaces.push(RateLimitReplace {
                    name: self.string(o, "name", &here),
                });
            }
        }
        Some(RateLimitPolicy {
            unit,
            requests_per_unit,
            unlimited: self.boolean(m, "unlimited", path),
            name: self.string(m, "name", path),
            replaces,
        })
    }
}

fn json_struct(m: &JsonMap) -> Struct {
    Struct {
        fields: m.iter().map(|(k, v)| (k.clone(), json_value(v))).collect(),
    }
}

fn json_value(v: &serde_json::Value) -> PbValue {
    use serde_json::Value as J;
    let kind = match v {
        J::Null => Kind::NullValue(0),
        J::Bool(b) => Kind::BoolValue(*b),
        J::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        J::String(s) => Kind::StringValue(s.clone()),
        J::Array(a) => Kind::ListValue(envoy_types::pb::google::protobuf::ListValue {
            values: a.iter().map(json_value).collect(),
        }),
        J::Object(o) => Kind::StructValue(json_struct(o)),
    };
    PbValue { kind: Some(kind) }
}

/// Packs `config` as the `Any` a control plane sends.
#[must_use]
pub fn pack(config: &RateLimitConfig) -> Any {
    Any {
        type_url: RATE_LIMIT_CONFIG_TYPE_URL.to_owned(),
        value: config.encode_to_vec(),
    }
}

#[cfg(test)]
mod tests;
