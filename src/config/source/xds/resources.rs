//! `RateLimitConfig` resources (package `ratelimit.config.ratelimit.v3`)
//! compiled into the same [`Config`] the file loader builds.
//!
//! Each resource is rendered as the YAML file it stands for and the whole set
//! goes through [`compile_texts_with`], so a pushed config is validated by
//! exactly the rules a file is (the Go service does the same: its
//! `ConfigXdsProtoToYaml` feeds the file loader). The proto has no presence
//! for scalars, so its defaults mean "absent": an empty `value` is a
//! key-only entry, an unset `rate_limit` is no rule, an empty `name` is no
//! name, unit `UNKNOWN` is no unit (an error unless `unlimited`).
//!
//! Errors name the resource (its `name`, else `resources[i]`) and the
//! descriptor path (`descriptors[0].descriptors[1].rate_limit`); they carry no
//! line, since the YAML is generated.

use crate::config::compile::{LoadOptions, compile_texts_with};
use crate::config::{Config, ConfigError, ConfigErrors};
use envoy_types::pb::google::protobuf::{Any, Struct, Value as PbValue, value::Kind};
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitReplace, RateLimitUnit,
};
use prost::Message as _;
use sha2::{Digest, Sha256};
use std::fmt::Write as _;

/// Type URL of the one resource type on the stream.
pub const RATE_LIMIT_CONFIG_TYPE_URL: &str =
    "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// Longest resource label (its `name`, or its domain) kept in errors, logs and
/// `/rlconfig`, in bytes; longer ones are cut with `...`.
pub const MAX_LABEL_BYTES: usize = 256;

/// Compiles one pushed set of resources (every `Any` of a
/// `DiscoveryResponse`) into a [`Config`], validated as files are.
///
/// The config's hash is SHA-256 over the rendered resources in label order,
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
    let mut texts = Vec::with_capacity(configs.len());
    for (i, c) in &configs {
        let label = label(*i, c);
        match render(c) {
            Ok(yaml) => texts.push((label, yaml.into_bytes())),
            Err(e) => errors.extend(
                e.into_iter()
                    .map(|(path, message)| err(&label, &path, message)),
            ),
        }
    }
    compile_rendered(texts, errors, load)
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
    let mut errors = Vec::new();
    let mut texts = Vec::with_capacity(configs.len());
    for (i, c) in configs.iter().enumerate() {
        let label = label(i, c);
        match render(c) {
            Ok(yaml) => texts.push((label, yaml.into_bytes())),
            Err(e) => errors.extend(
                e.into_iter()
                    .map(|(path, message)| err(&label, &path, message)),
            ),
        }
    }
    compile_rendered(texts, errors, load)
}

fn compile_rendered(
    mut texts: Vec<(String, Vec<u8>)>,
    mut errors: Vec<ConfigError>,
    load: LoadOptions,
) -> Result<Config, ConfigErrors> {
    texts.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    match compile_texts_with(&texts, load) {
        Ok(mut config) if errors.is_empty() => {
            config.hash = hash_rendered(&texts);
            Ok(config)
        }
        Ok(_) => Err(ConfigErrors(errors)),
        Err(ConfigErrors(more)) => {
            errors.extend(more.into_iter().map(|mut e| {
                // Lines point into the generated YAML: meaningless to the
                // control plane's operator.
                e.line = None;
                e
            }));
            Err(ConfigErrors(errors))
        }
    }
}

/// SHA-256 (hex) over `(label, rendered YAML)` pairs, already sorted.
fn hash_rendered(texts: &[(String, Vec<u8>)]) -> String {
    let mut h = Sha256::new();
    h.update(b"xds\0");
    for (name, bytes) in texts {
        h.update((name.len() as u64).to_be_bytes());
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
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

/// A YAML double-quoted scalar: JSON string escapes are a subset of YAML's.
fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

type RenderErrors = Vec<(String, String)>;

/// The YAML file one resource stands for.
fn render(c: &RateLimitConfig) -> Result<String, RenderErrors> {
    let mut out = String::with_capacity(64 + 96 * c.descriptors.len());
    let mut errors = Vec::new();
    let _ = writeln!(out, "domain: {}", quoted(&c.domain));
    if !c.descriptors.is_empty() {
        out.push_str("descriptors:\n");
        render_descriptors(&mut out, &mut errors, &c.descriptors, 0, "descriptors");
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

fn render_descriptors(
    out: &mut String,
    errors: &mut RenderErrors,
    descs: &[RateLimitDescriptor],
    depth: usize,
    path: &str,
) {
    let pad = "  ".repeat(depth + 1);
    for (i, d) in descs.iter().enumerate() {
        let here = format!("{path}[{i}]");
        let _ = writeln!(out, "{pad}- key: {}", quoted(&d.key));
        let pad = format!("{pad}  ");
        if !d.value.is_empty() {
            let _ = writeln!(out, "{pad}value: {}", quoted(&d.value));
        }
        for (flag, on) in [
            ("shadow_mode", d.shadow_mode),
            ("detailed_metric", d.detailed_metric),
            ("quota_mode", d.quota_mode),
        ] {
            if on {
                let _ = writeln!(out, "{pad}{flag}: true");
            }
        }
        if let Some(m) = &d.metadata {
            match struct_json(m) {
                Ok(json) if json.is_empty() => {}
                Ok(json) => {
                    let text = serde_json::Value::Object(json).to_string();
                    let _ = writeln!(out, "{pad}metadata: {text}");
                }
                Err(e) => errors.push((format!("{here}.metadata"), e)),
            }
        }
        if let Some(rl) = &d.rate_limit {
            render_policy(out, &pad, rl);
        }
        if !d.descriptors.is_empty() {
            let _ = writeln!(out, "{pad}descriptors:");
            render_descriptors(
                out,
                errors,
                &d.descriptors,
                depth + 2,
                &format!("{here}.descriptors"),
            );
        }
    }
}

fn render_policy(out: &mut String, pad: &str, rl: &RateLimitPolicy) {
    let _ = writeln!(out, "{pad}rate_limit:");
    let pad = format!("{pad}  ");
    if rl.unlimited {
        let _ = writeln!(out, "{pad}unlimited: true");
        if rl.requests_per_unit != 0 {
            let _ = writeln!(out, "{pad}requests_per_unit: {}", rl.requests_per_unit);
        }
    } else {
        let _ = writeln!(out, "{pad}requests_per_unit: {}", rl.requests_per_unit);
    }
    match RateLimitUnit::try_from(rl.unit) {
        // UNKNOWN is "no unit": fine with `unlimited`, an error without it.
        Ok(RateLimitUnit::Unknown) if rl.unlimited => {}
        Ok(unit) => {
            let _ = writeln!(out, "{pad}unit: {}", quoted(unit.as_str_name()));
        }
        Err(_) => {
            let _ = writeln!(
                out,
                "{pad}unit: {}",
                quoted(&format!("enum value {}", rl.unit))
            );
        }
    }
    if !rl.name.is_empty() {
        let _ = writeln!(out, "{pad}name: {}", quoted(&rl.name));
    }
    if !rl.replaces.is_empty() {
        let _ = writeln!(out, "{pad}replaces:");
        for RateLimitReplace { name } in &rl.replaces {
            let _ = writeln!(out, "{pad}  - name: {}", quoted(name));
        }
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
            let here = format!("{path}[{i}]");
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
mod tests {
    use super::*;
    use crate::config::{Policy, Unit};

    fn desc(key: &str, value: &str) -> RateLimitDescriptor {
        RateLimitDescriptor {
            key: key.into(),
            value: value.into(),
            ..Default::default()
        }
    }

    fn limit(rpu: u32, unit: RateLimitUnit) -> Option<RateLimitPolicy> {
        Some(RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit: rpu,
            ..Default::default()
        })
    }

    /// The shape Envoy Gateway sends for a route rule with a header match.
    fn eg(domain: &str, rpu: u32, unit: RateLimitUnit) -> RateLimitConfig {
        let mut leaf = desc("rule-0-match-0", "rule-0-match-0");
        leaf.rate_limit = limit(rpu, unit);
        let mut route = desc(
            "httproute/default/backend/rule/0/match/0/*",
            "httproute/default/backend/rule/0/match/0/*",
        );
        route.descriptors = vec![leaf];
        RateLimitConfig {
            name: domain.into(),
            domain: domain.into(),
            descriptors: vec![route],
        }
    }

    #[test]
    fn envoy_gateway_shapes_compile_to_the_rules_a_file_would_give() {
        let mut cidr = desc("masked_remote_address", "0.0.0.0/0");
        let mut per_ip = desc("remote_address", "");
        per_ip.rate_limit = limit(3, RateLimitUnit::Month);
        per_ip.shadow_mode = true;
        cidr.descriptors = vec![per_ip];
        let mut shared = desc("default/policy/rule/0", "default/policy/rule/0");
        let mut week = desc("rule-0-match--1", "rule-0-match--1");
        week.rate_limit = limit(7, RateLimitUnit::Week);
        shared.descriptors = vec![week, cidr];
        let set = [
            pack(&eg("default/eg/http", 5, RateLimitUnit::Second)),
            pack(&RateLimitConfig {
                name: "default/policy".into(),
                domain: "default/policy".into(),
                descriptors: vec![shared],
            }),
        ];
        let c = compile_resources(&set, LoadOptions::default()).unwrap();
        assert_eq!(c.domains.len(), 2);
        let d = &c.domains["default/policy"];
        let ip = d
            .rules
            .iter()
            .find(|r| r.path.ends_with(".remote_address"))
            .unwrap();
        assert_eq!(
            ip.path,
            "default/policy.default/policy/rule/0_default/policy/rule/0.masked_remote_address_0.0.0.0/0.remote_address"
        );
        assert!(ip.shadow_mode);
        assert_eq!(
            ip.policy,
            Policy::Limited {
                requests_per_unit: 3,
                unit: Unit::Month,
                burst: 3,
                max_debt: None
            }
        );
        let wk = d
            .rules
            .iter()
            .find(|r| r.path.ends_with("rule-0-match--1"))
            .unwrap();
        assert_eq!(
            wk.policy,
            Policy::Limited {
                requests_per_unit: 7,
                unit: Unit::Week,
                burst: 7,
                max_debt: None
            }
        );
        assert_eq!(d.file, "default/policy");
    }

    #[test]
    fn hash_depends_on_content_not_on_resource_order() {
        let a = pack(&eg("a", 1, RateLimitUnit::Minute));
        let b = pack(&eg("b", 2, RateLimitUnit::Minute));
        let one = compile_resources(&[a.clone(), b.clone()], LoadOptions::default()).unwrap();
        let two = compile_resources(&[b, a.clone()], LoadOptions::default()).unwrap();
        assert_eq!(one.hash, two.hash);
        let other = compile_resources(&[a], LoadOptions::default()).unwrap();
        assert_ne!(one.hash, other.hash);
        assert_ne!(
            compile_resources(&[], LoadOptions::default()).unwrap().hash,
            other.hash
        );
    }

    #[test]
    fn empty_set_is_a_config_without_domains() {
        let c = compile_resources(&[], LoadOptions::default()).unwrap();
        assert!(c.domains.is_empty());
    }

    #[test]
    fn errors_name_the_resource_and_the_descriptor_path() {
        let mut bad = eg("default/eg/http", 5, RateLimitUnit::Unknown);
        bad.descriptors[0].descriptors.push(desc("", "x"));
        let e = compile_resources(&[pack(&bad)], LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "default/eg/http: descriptors[0].descriptors[0].rate_limit: bad unit 'UNKNOWN'"
            ),
            "{e}"
        );
        assert!(
            e.contains("default/eg/http: descriptors[0].descriptors[1]: descriptor without 'key'"),
            "{e}"
        );
    }

    #[test]
    fn duplicate_domains_and_unlimited_with_a_unit_are_refused() {
        let a = pack(&eg("d", 1, RateLimitUnit::Minute));
        let mut b = eg("d", 2, RateLimitUnit::Minute);
        b.name = "other".into();
        let e = compile_resources(&[a, pack(&b)], LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("duplicate domain 'd'"), "{e}");
        let mut u = eg("u", 1, RateLimitUnit::Minute);
        u.descriptors[0].descriptors[0]
            .rate_limit
            .as_mut()
            .unwrap()
            .unlimited = true;
        let e = compile_resources(&[pack(&u)], LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'unit' must not be given with 'unlimited: true'"),
            "{e}"
        );
        // Unlimited without a unit is fine.
        u.descriptors[0].descriptors[0]
            .rate_limit
            .as_mut()
            .unwrap()
            .unit = 0;
        let c = compile_resources(&[pack(&u)], LoadOptions::default()).unwrap();
        assert_eq!(c.domains["u"].rules[0].policy, Policy::Unlimited);
    }

    #[test]
    fn merged_domains_follow_the_load_options() {
        let a = pack(&eg("d", 1, RateLimitUnit::Minute));
        let mut b = eg("d", 2, RateLimitUnit::Minute);
        b.name = "other".into();
        b.descriptors[0].key = "another".into();
        let c = compile_resources(
            &[a, pack(&b)],
            LoadOptions {
                merge_domains: true,
            },
        )
        .unwrap();
        assert_eq!(c.domains["d"].rules.len(), 2);
    }

    #[test]
    fn wrong_type_url_unknown_unit_and_garbage_are_errors() {
        let mut wrong = pack(&eg("a", 1, RateLimitUnit::Minute));
        wrong.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
        let garbage = Any {
            type_url: RATE_LIMIT_CONFIG_TYPE_URL.into(),
            value: vec![0xff, 0xff, 0xff],
        };
        let mut odd = eg("b", 1, RateLimitUnit::Minute);
        odd.descriptors[0].descriptors[0]
            .rate_limit
            .as_mut()
            .unwrap()
            .unit = 42;
        let e = compile_resources(&[wrong, garbage, pack(&odd)], LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("resources[0]: type URL 'type.googleapis.com/envoy.config.cluster.v3.Cluster' is not"), "{e}");
        assert!(
            e.contains("resources[1]: does not decode as RateLimitConfig"),
            "{e}"
        );
        assert!(e.contains("bad unit 'enum value 42'"), "{e}");
    }

    #[test]
    fn strings_that_look_like_yaml_stay_literal() {
        let mut d = desc("k: v", "~");
        d.rate_limit = limit(1, RateLimitUnit::Hour);
        let mut q = desc("\"quoted\"\n", "010");
        q.rate_limit = limit(2, RateLimitUnit::Hour);
        let c = compile_resources(
            &[pack(&RateLimitConfig {
                name: String::new(),
                domain: "y: es #".into(),
                descriptors: vec![d, q],
            })],
            LoadOptions::default(),
        )
        .unwrap();
        let d = &c.domains["y: es #"];
        assert_eq!(d.rules[0].path, "y: es #.k: v_~");
        assert_eq!(d.rules[1].path, "y: es #.\"quoted\"\n_010");
    }

    #[test]
    fn metadata_becomes_the_rules_metadata() {
        let mut d = desc("k", "v");
        d.rate_limit = limit(1, RateLimitUnit::Hour);
        d.metadata = Some(json_struct(
            serde_json::json!({"team": "a", "n": 2.5, "l": [true, null]})
                .as_object()
                .unwrap(),
        ));
        let c = compile_resources(
            &[pack(&RateLimitConfig {
                name: "m".into(),
                domain: "m".into(),
                descriptors: vec![d],
            })],
            LoadOptions::default(),
        )
        .unwrap();
        let m = c.domains["m"].rules[0].metadata.as_deref().unwrap();
        assert_eq!(
            serde_json::Value::Object(m.clone()),
            serde_json::json!({"team": "a", "n": 2.5, "l": [true, null]})
        );
    }

    #[test]
    fn envoy_gateway_dump_parses_and_compiles() {
        let dump = r#"name: first-listener
domain: first-listener
descriptors:
  - key: first-route
    value: ""
    rate_limit: null
    descriptors:
      - key: rule-0-match-0
        value: rule-0-match-0
        rate_limit:
          requests_per_unit: 5
          unit: MONTH
          unlimited: false
          name: ""
          replaces: []
        descriptors: []
        shadow_mode: false
        quota_mode: false
        detailed_metric: false
        value_to_metric: false
        share_threshold: false
    shadow_mode: false
    detailed_metric: false
---
name: test-namespace/test-policy-1
domain: test-namespace/test-policy-1
descriptors:
  - key: x
    rate_limit:
      requests_per_unit: 1
      unit: 7
"#;
        let configs = parse_dump("dump.yaml", dump).unwrap();
        assert_eq!(configs.len(), 2);
        let c = compile_configs(&configs, LoadOptions::default()).unwrap();
        let r = &c.domains["first-listener"].rules[0];
        assert_eq!(
            r.path,
            "first-listener.first-route.rule-0-match-0_rule-0-match-0"
        );
        assert_eq!(
            c.domains["test-namespace/test-policy-1"].rules[0].policy,
            Policy::Limited {
                requests_per_unit: 1,
                unit: Unit::Week,
                burst: 1,
                max_debt: None
            }
        );
        // The same resources pushed over xDS hash the same.
        let packed: Vec<Any> = configs.iter().map(pack).collect();
        assert_eq!(
            compile_resources(&packed, LoadOptions::default())
                .unwrap()
                .hash,
            c.hash
        );
    }

    #[test]
    fn dump_errors_name_the_document_and_the_field() {
        let dump = "domain: a\ndescriptors:\n  - key: k\n    share_threshold: true\n    rate_limit: {unit: FORTNIGHT}\n";
        let e = parse_dump("d.yaml", dump).unwrap_err().to_string();
        assert!(
            e.contains(
                "d.yaml[document 0]: descriptors[0]: share_threshold: true cannot be sent over xDS"
            ),
            "{e}"
        );
        assert!(
            e.contains(
                "d.yaml[document 0]: descriptors[0].rate_limit: unit: unknown unit 'FORTNIGHT'"
            ),
            "{e}"
        );
    }
}
