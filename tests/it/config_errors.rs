//! One test per config rejection rule (docs/design.md, "Configuration
//! files"): each error names the file,
//! the line where the parser can give it, and the descriptor path.

use bucket_rls::config::compile::compile_texts;
use bucket_rls::config::files::load_source;

/// Compiles one file and returns every error as text (panics if it loads).
pub(super) fn errors(name: &str, yaml: &str) -> Vec<String> {
    match compile_texts(&[(name.to_owned(), yaml.as_bytes().to_vec())]) {
        Ok(_) => panic!("{name} must not load:\n{yaml}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

/// Asserts that exactly one error is reported and that it contains every needle.
pub(super) fn one_error(name: &str, yaml: &str, needles: &[&str]) -> String {
    let errs = errors(name, yaml);
    assert_eq!(errs.len(), 1, "expected one error, got {errs:#?}");
    for n in needles {
        assert!(errs[0].contains(n), "error {:?} lacks {n:?}", errs[0]);
    }
    errs[0].clone()
}

#[test]
fn yaml_syntax_error_names_file_and_line() {
    let e = one_error(
        "edge.yaml",
        "domain: edge\ndescriptors:\n  - key: a\n    value: \"unclosed\n",
        &["edge.yaml:", "invalid YAML", "unclosed quote"],
    );
    assert!(e.starts_with("edge.yaml:4:"), "{e}");
}

#[test]
fn a_tab_is_reported_on_its_own_line() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n\trate_limit: {unit: second, requests_per_unit: 1}\n",
        &[
            "t.yaml:4:",
            "column 1",
            "a tab; YAML indents with spaces only",
        ],
    );
}

#[test]
fn wrong_types_say_what_was_expected() {
    for (yaml, line, what) in [
        (
            "domain: d\ndescriptors:\n  - key: k\n    shadow_mode: [true]\n",
            4,
            "a single value",
        ),
        ("domain: d\ndescriptors: {k: v}\n", 2, "a list"),
        ("- a\n", 1, "a mapping"),
    ] {
        one_error(
            "t.yaml",
            yaml,
            &[&format!("t.yaml:{line}:"), "wrong type", what],
        );
    }
    one_error(
        "t.yaml",
        "domain: a\ndomain: b\ndescriptors: []\n",
        &["t.yaml:2:", "duplicate key 'domain'"],
    );
    let e = one_error(
        "t.yaml",
        "domain: a\ndescriptors: []\n---\ndomain: b\n",
        &["t.yaml:4:", "one domain per file"],
    );
    assert!(!e.contains("from_str_multiple"), "{e}");
}

#[test]
fn misspelt_key_in_rate_limit() {
    let yaml = "domain: edge\ndescriptors:\n  - key: remote_address\n    value: 10.0.0.7\n    descriptors:\n      - key: api_path\n        value: /api\n        rate_limit:\n          unlimied: true          # typo\n";
    one_error(
        "edge.yaml",
        yaml,
        &[
            "edge.yaml:9:",
            "descriptors[0](key=remote_address, value=10.0.0.7).descriptors[0](key=api_path, value=/api).rate_limit",
            "unknown key 'unlimied': did you mean 'unlimited'?",
        ],
    );
}

/// Every level of an error's path names its descriptor's key and value
/// (a wildcard as written, a key-only level by its key), not only its index.
#[test]
fn a_nested_error_path_names_each_levels_key_and_value() {
    let yaml = "domain: edge
descriptors:
  - key: tenant
    value: other
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: tenant
    value: acme
    descriptors:
      - key: path
        value: /api/*
        descriptors:
          - key: user
            rate_limit:
              unit: second
              requests_per_unit: 5
              brust: 10
";
    let e = one_error("edge.yaml", yaml, &[]);
    assert_eq!(
        e,
        "edge.yaml:16: descriptors[1](key=tenant, value=acme).descriptors[0](key=path, value=/api/*).descriptors[0](key=user).rate_limit: unknown key 'brust': did you mean 'burst'? (expected one of: unit, requests_per_unit, burst, max_debt, algorithm, name, unlimited, replaces)"
    );
}

/// Keys and values are operator text: one longer than 64 characters is cut
/// (marked with `…`), so an error line stays short whatever the file holds.
#[test]
fn a_very_long_key_or_value_is_cut_in_the_error_path() {
    let (key, value) = ("k".repeat(100), "v".repeat(100_000));
    let yaml = format!(
        "domain: d\ndescriptors:\n  - key: {key}\n    value: {value}\n    rate_limit: {{unit: fortnight, requests_per_unit: 1}}\n"
    );
    let e = one_error("t.yaml", &yaml, &[]);
    assert_eq!(
        e,
        format!(
            "t.yaml:5: descriptors[0](key={}…, value={}…).rate_limit: bad unit 'fortnight': expected second, minute, hour, day, week, month or year",
            "k".repeat(64),
            "v".repeat(64)
        )
    );
    // Escapes count: 100 control characters show as 12 escapes (`\u{1}`,
    // five characters each) within the 64.
    let yaml = format!(
        "domain: d\ndescriptors:\n  - key: k\n    value: \"{}\"\n    shadow_mode: maybe\n",
        "\\x01".repeat(100)
    );
    let e = one_error("t.yaml", &yaml, &[]);
    assert!(
        e.starts_with(&format!(
            "t.yaml:5: descriptors[0](key=k, value=\"{}\"…): shadow_mode: ",
            "\\u{1}".repeat(12)
        )),
        "{e}"
    );
    // 64 characters, not bytes: a multi-byte value is cut on a character.
    let yaml = format!(
        "domain: d\ndescriptors:\n  - key: k\n    value: {}\n    shadow_mode: maybe\n",
        "é".repeat(65)
    );
    let e = one_error("t.yaml", &yaml, &[]);
    assert!(
        e.starts_with(&format!(
            "t.yaml:5: descriptors[0](key=k, value={}…): shadow_mode: ",
            "é".repeat(64)
        )),
        "{e}"
    );
}

/// A key or value that is empty, holds a space, a control or invisible
/// character, or the path's own punctuation is shown quoted and escaped, so
/// the path stays one line and reads one way.
#[test]
fn a_key_or_value_that_is_not_plain_text_is_quoted_in_the_error_path() {
    for (value, shown) in [
        ("\"a b\"", "\"a b\""),
        ("\"x=1, y)\"", "\"x=1, y)\""),
        ("\"line\\nbreak\"", "\"line\\nbreak\""),
        ("\"\\u202Eevil\"", "\"\\u{202e}evil\""),
        ("'say \"hi\"'", "\"say \\\"hi\\\"\""),
        ("10.0.0.0/8", "10.0.0.0/8"),
        ("Zürich", "Zürich"),
    ] {
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: k\n    value: {value}\n    shadow_mode: maybe\n"
        );
        one_error(
            "t.yaml",
            &yaml,
            &[&format!(
                "descriptors[0](key=k, value={shown}): shadow_mode: "
            )],
        );
    }
}

#[test]
fn near_misses_of_a_known_key_suggest_it() {
    for (typo, want) in [
        ("brust", "burst"),
        ("requestsperunit", "requests_per_unit"),
        ("Unit", "unit"),
        ("max_dept", "max_debt"),
    ] {
        let yaml = format!(
            "domain: edge\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: second\n      requests_per_unit: 5\n      {typo}: 5\n"
        );
        one_error(
            "edge.yaml",
            &yaml,
            &[&format!("unknown key '{typo}': did you mean '{want}'?")],
        );
    }
    // Far from every known key: no suggestion, the list only.
    let e = one_error(
        "edge.yaml",
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: second\n      requests_per_unit: 5\n      colour: red\n",
        &["unknown key 'colour' (expected one of: "],
    );
    assert!(!e.contains("did you mean"), "{e}");
}

#[test]
fn unknown_key_at_top_level() {
    one_error(
        "t.yaml",
        "domain: d\ndomian: x\ndescriptors: []\n",
        &["t.yaml:2:", "unknown key 'domian'"],
    );
}

#[test]
fn unknown_key_on_descriptor() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    valeu: b\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &["t.yaml:4: descriptors[0](key=a): unknown key 'valeu'"],
    );
}

#[test]
fn known_key_at_wrong_level() {
    let e = one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    requests_per_unit: 5\n",
        &[
            "t.yaml:4:",
            "descriptors[0](key=a): unknown key",
            "'requests_per_unit'",
            "belongs in rate_limit",
        ],
    );
    assert!(e.contains("unknown key"), "{e}");
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, shadow_mode: true}\n",
        &[
            "descriptors[0](key=a).rate_limit: unknown key",
            "'shadow_mode'",
            "belongs in a descriptor",
        ],
    );
    one_error(
        "t.yaml",
        "domain: d\nkey: a\ndescriptors: []\n",
        &["t.yaml:2:", "'key'", "belongs in a descriptor"],
    );
}

#[test]
fn metadata_belongs_on_the_descriptor_not_in_rate_limit() {
    let e = one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, metadata: {x: 1}}\n",
        &[
            "t.yaml:4:",
            "descriptors[0](key=a).rate_limit: unknown key",
            "'metadata'",
            "belongs in a descriptor",
        ],
    );
    assert!(!e.contains("unsupported"), "{e}");
}

#[test]
fn quota_mode_value_to_metric_and_metadata_must_be_well_formed() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    quota_mode: sometimes\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &[
            "t.yaml:4:",
            "descriptors[0](key=a): ",
            "quota_mode: expected true or false, got 'sometimes'",
        ],
    );
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    value_to_metric: 2\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &[
            "t.yaml:4:",
            "descriptors[0](key=a): ",
            "value_to_metric: expected true or false",
        ],
    );
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    metadata: [1, 2]\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &[
            "t.yaml:4:",
            "descriptors[0](key=a): ",
            "metadata must be a mapping",
            "got a list",
        ],
    );
}

#[test]
fn empty_or_missing_domain() {
    one_error(
        "t.yaml",
        "domain: ''\ndescriptors: []\n",
        &["t.yaml:1:", "domain", "domain must not be empty"],
    );
    one_error(
        "t.yaml",
        "descriptors: []\n",
        &["t.yaml", "missing 'domain'"],
    );
    one_error("t.yaml", "", &["t.yaml", "empty file"]);
}

#[test]
fn duplicate_domain_across_files() {
    let f = |n: &str| (n.to_owned(), b"domain: same\ndescriptors: []\n".to_vec());
    let e = compile_texts(&[f("a.yaml"), f("b.yaml")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("b.yaml") && e.contains("duplicate domain 'same'") && e.contains("a.yaml"),
        "{e}"
    );
}

#[test]
fn descriptor_without_key() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - value: x\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &["t.yaml:3: descriptors[0](value=x): descriptor without 'key'"],
    );
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: ''\n",
        &["t.yaml:5: descriptors[0](key=a).descriptors[0](key=\"\"): descriptor without 'key'"],
    );
}

#[test]
fn duplicate_siblings() {
    let yaml = "domain: notify\ndescriptors:\n  - key: sender\n    rate_limit: {unit: minute, requests_per_unit: 5}\n  - key: sender\n    rate_limit: {unit: day, requests_per_unit: 200}\n";
    one_error(
        "n.yaml",
        yaml,
        &[
            "n.yaml:5:",
            "descriptors[1](key=sender): duplicate",
            "duplicate descriptor composite key 'notify.sender'",
        ],
    );
    let variant = r"
domain: domain
descriptors:
  - key: generic_key
    value: abc
    descriptors:
      - key: PATH
        rate_limit: {unit: minute, requests_per_unit: 3}
  - key: generic_key
    value: abc
    descriptors:
      - key: PATH
        value: /foo
        rate_limit: {unit: minute, requests_per_unit: 100}
";
    one_error(
        "v.yaml",
        variant,
        &[
            "v.yaml:9:",
            "descriptors[1](key=generic_key, value=abc): duplicate descriptor composite key 'domain.generic_key_abc'",
        ],
    );
}

/// envoyproxy/ratelimit reads an empty or null value as "no value" (one bucket
/// per value); bucket-rls refuses both loudly instead of guessing.
#[test]
fn null_or_empty_value_is_an_error() {
    // A null value is no value: the path names the key; an empty one is
    // shown quoted.
    for (v, path) in [
        ("~", "descriptors[0](key=c):"),
        ("null", "descriptors[0](key=c):"),
        ("", "descriptors[0](key=c):"),
        ("\"\"", "descriptors[0](key=c, value=\"\"):"),
        ("''", "descriptors[0](key=c, value=\"\"):"),
    ] {
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: c\n    value: {v}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
        );
        one_error(
            "t.yaml",
            &yaml,
            &["t.yaml:4:", path, "'value' is empty or null"],
        );
    }
    // Quoted, it is the literal text.
    let c = compile_texts(&[("t.yaml".into(), b"domain: d\ndescriptors:\n  - key: c\n    value: \"~\"\n    rate_limit: {unit: second, requests_per_unit: 1}\n".to_vec())]).expect("loads");
    assert!(bucket_rls::matcher::find(&c.domains["d"].root, &[("c", "~")]).is_some());
    assert!(bucket_rls::matcher::find(&c.domains["d"].root, &[("c", "x")]).is_none());
}

#[test]
fn hash_depends_on_file_names_and_bytes_not_on_the_path() {
    let text = b"domain: d\ndescriptors: []\n".to_vec();
    let a = compile_texts(&[("/etc/bucket-rls/rl.yaml".into(), text.clone())]).expect("loads");
    let b = compile_texts(&[("config/rl.yaml".into(), text.clone())]).expect("loads");
    let c = compile_texts(&[("config/other.yaml".into(), text.clone())]).expect("loads");
    let mut changed = text;
    changed.push(b'\n');
    let d = compile_texts(&[("config/rl.yaml".into(), changed)]).expect("loads");
    assert_eq!(a.hash, b.hash);
    assert_ne!(b.hash, c.hash);
    assert_ne!(b.hash, d.hash);
}

#[test]
fn bad_or_missing_unit() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
        &[
            "t.yaml:4:",
            "descriptors[0](key=a).rate_limit: ",
            "bad unit 'fortnight'",
        ],
    );
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      requests_per_unit: 1\n",
        &[
            "t.yaml:5:",
            "descriptors[0](key=a).rate_limit: ",
            "missing 'unit'",
        ],
    );
    // Case-insensitive units load.
    assert!(compile_texts(&[("t.yaml".into(), b"domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: MINUTE, requests_per_unit: 1}\n".to_vec())]).is_ok());
}

#[test]
fn bad_requests_per_unit() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: -1}\n",
        &[
            "descriptors[0](key=a).rate_limit: ",
            "requests_per_unit",
            "'-1'",
        ],
    );
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 4294967296}\n",
        &["requests_per_unit", "4294967296"],
    );
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second}\n",
        &[
            "descriptors[0](key=a).rate_limit: ",
            "missing 'requests_per_unit'",
        ],
    );
}

/// A number whose meaning differs between the Go service's YAML 1.1
/// reading (a leading 0 is octal) and the decimal one is refused with both
/// readings, in block and flow style, in every integer key.
#[test]
fn a_leading_zero_number_names_the_octal_and_the_decimal_reading() {
    for (rate_limit, line, needles) in [
        (
            "    rate_limit:\n      unit: minute\n      requests_per_unit: 010\n",
            6,
            ["requests_per_unit: '010'", "octal 8", "gives 10"],
        ),
        (
            "    rate_limit: {unit: minute, requests_per_unit: 0100}\n",
            4,
            ["requests_per_unit: '0100'", "octal 64", "gives 100"],
        ),
        (
            "    rate_limit: {unit: minute, requests_per_unit: 10, burst: 012}\n",
            4,
            ["burst: '012'", "octal 10", "gives 12"],
        ),
    ] {
        let yaml = format!("domain: d\ndescriptors:\n  - key: a\n{rate_limit}");
        let e = one_error("t.yaml", &yaml, &needles);
        assert!(
            e.starts_with(&format!(
                "t.yaml:{line}: descriptors[0](key=a).rate_limit: "
            )),
            "{e}"
        );
    }
}

/// What the Go service refuses is refused: a quoted number or boolean is a
/// string to its YAML parser.
#[test]
fn quoted_numbers_and_booleans_are_refused_as_the_go_service_refuses_them() {
    for (body, needle) in [
        (
            "    rate_limit: {unit: minute, requests_per_unit: \"10\"}\n",
            "requests_per_unit: expected a number, got the quoted string \"10\"",
        ),
        (
            "    rate_limit:\n      unit: minute\n      requests_per_unit: '10'\n",
            "requests_per_unit: expected a number, got the quoted string \"10\"",
        ),
        (
            "    shadow_mode: \"true\"\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
            "shadow_mode: expected true or false, got the quoted string \"true\"",
        ),
        (
            "    rate_limit: {unlimited: 'yes'}\n",
            "unlimited: expected true or false, got the quoted string \"yes\"",
        ),
    ] {
        let yaml = format!("domain: d\ndescriptors:\n  - key: a\n{body}");
        let errs = errors("t.yaml", &yaml);
        assert!(
            errs.iter()
                .any(|e| e.starts_with("t.yaml:") && e.contains(needle)),
            "{needle}: {errs:#?}"
        );
    }
}

/// What the Go service refuses is refused: a number its YAML 1.1 parser
/// reads as a float (`09` is not octal, so it is the float 9) fails its
/// check of the values before decoding ("error checking config").
#[test]
fn numbers_the_go_service_reads_as_floats_are_refused_as_it_refuses_them() {
    for literal in ["09", "08", "1e3", "10.0", "010.0", "10.5"] {
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {{unit: minute, requests_per_unit: {literal}}}\n"
        );
        one_error(
            "t.yaml",
            &yaml,
            &[
                "t.yaml:4: descriptors[0](key=a).rate_limit: ",
                &format!(
                    "requests_per_unit: expected an integer from 0 to 4294967295, got '{literal}', a float"
                ),
                "error checking config",
            ],
        );
    }
}

/// Numbers and booleans that the Go service reads with the meaning a
/// reader sees load with that meaning.
#[test]
fn numbers_and_booleans_the_go_service_reads_alike_load() {
    use bucket_rls::config::Policy;
    for (literal, expected) in [
        ("007", 7),
        ("00", 0),
        ("0x10", 16),
        ("0o10", 8),
        ("1_000", 1000),
        ("+10", 10),
    ] {
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: yes\n    rate_limit: {{unit: minute, requests_per_unit: {literal}}}\n  - key: b\n    rate_limit: {{unlimited: Y}}\n"
        );
        let config = compile_texts(&[("t.yaml".into(), yaml.into_bytes())])
            .unwrap_or_else(|e| panic!("{literal} must load: {e}"));
        let domain = &config.domains["d"];
        let a = domain
            .rules
            .iter()
            .find(|r| r.path == "d.a")
            .expect("rule a");
        assert!(
            matches!(a.policy, Policy::Limited { requests_per_unit, .. } if requests_per_unit == expected),
            "{literal}: {:?}",
            a.policy
        );
        assert!(a.shadow_mode, "yes is true");
        let b = domain
            .rules
            .iter()
            .find(|r| r.path == "d.b")
            .expect("rule b");
        assert!(matches!(b.policy, Policy::Unlimited), "Y is true");
    }
}

#[test]
fn unlimited_with_unit() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit: second}\n",
        &[
            "t.yaml:4:",
            "descriptors[0](key=a).rate_limit: ",
            "'unit' must not be given with 'unlimited: true'",
        ],
    );
}

#[test]
fn an_empty_value_does_not_hide_the_other_problems_of_its_descriptor() {
    let errs = errors(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    value: \"\"\n    rate_limit: {unit: minutes, requests_per_unit: -1}\n    descriptors:\n      - key: b\n        rate_limit: {unit: second}\n",
    );
    assert_eq!(errs.len(), 4, "{errs:#?}");
    assert!(errs.iter().any(|e| e.contains("'value' is empty or null")));
    assert!(errs.iter().any(|e| e.contains("bad unit 'minutes'")));
    assert!(
        errs.iter()
            .any(|e| e.contains("requests_per_unit: expected an integer"))
    );
    assert!(errs.iter().any(|e| {
        e.contains("descriptors[0](key=a, value=\"\").descriptors[0](key=b).rate_limit: ")
            && e.contains("missing 'requests_per_unit'")
    }));
}

#[test]
fn unlimited_with_a_rate_loads_as_in_the_go_service() {
    let c = compile_texts(&[(
        "t.yaml".into(),
        b"domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, requests_per_unit: 5}\n".to_vec(),
    )])
    .expect("loads");
    assert_eq!(
        c.domains["d"].rules[0].policy,
        bucket_rls::config::Policy::Unlimited
    );
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, requests_per_unit: lots}\n",
        &["t.yaml:4:", "requests_per_unit: expected an integer"],
    );
}

#[test]
fn zero_burst_with_positive_rate() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 5, burst: 0}\n",
        &[
            "t.yaml:4:",
            "descriptors[0](key=a).rate_limit: ",
            "burst must be at least 1",
        ],
    );
    // burst 0 with rate 0 is a block rule and loads.
    assert!(compile_texts(&[("t.yaml".into(), b"domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 0, burst: 0}\n".to_vec())]).is_ok());
}

/// `max_debt` is refused on an `unlimited` rule, as a negative or
/// non-integer number, and on a rule of rate 0 (it could never repay);
/// every error names the file, the line and the path.
#[test]
fn bad_max_debt_is_refused_with_file_line_and_path() {
    let rule =
        |rl: &str| format!("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      {rl}\n");
    for (rl, line, needle) in [
        (
            "{unlimited: true, max_debt: 10}",
            "t.yaml:5:",
            "'max_debt' must not be given with 'unlimited: true'",
        ),
        (
            "{unit: hour, requests_per_unit: 5, max_debt: -1}",
            "t.yaml:5:",
            "max_debt: expected an integer from 0 to 4294967295, got '-1'",
        ),
        (
            "{unit: hour, requests_per_unit: 5, max_debt: 2.5}",
            "t.yaml:5:",
            "max_debt: expected an integer from 0 to 4294967295, got '2.5'",
        ),
        (
            "{unit: hour, requests_per_unit: 5, max_debt: lots}",
            "t.yaml:5:",
            "got 'lots'",
        ),
        (
            "{unit: hour, requests_per_unit: 0, max_debt: 5}",
            "t.yaml:5:",
            "max_debt must be 0 when requests_per_unit is 0",
        ),
    ] {
        one_error(
            "t.yaml",
            &rule(rl),
            &[line, "descriptors[0](key=a).rate_limit: ", needle],
        );
    }
    // A debt bound on a limited rule, and 0 on a rule of rate 0, load.
    for rl in [
        "{unit: hour, requests_per_unit: 5, max_debt: 1_000}",
        "{unit: hour, requests_per_unit: 0, max_debt: 0}",
    ] {
        assert!(
            compile_texts(&[("t.yaml".into(), rule(rl).into_bytes())]).is_ok(),
            "{rl}"
        );
    }
}

#[test]
fn empty_replaces_name_and_self_replacement() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      replaces: [{name: ''}]\n      unit: minute\n      requests_per_unit: 5\n",
        &[
            "t.yaml:5:",
            "descriptors[0](key=a).rate_limit.replaces[0]: ",
            "non-empty 'name'",
        ],
    );
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      name: me\n      replaces: [{name: me}]\n      unit: minute\n      requests_per_unit: 5\n",
        &[
            "t.yaml:5:",
            "descriptors[0](key=a).rate_limit: ",
            "rule 'me' replaces itself",
        ],
    );
}

#[test]
fn share_threshold_without_wildcard() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    value: exact\n    share_threshold: true\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &[
            "t.yaml:3:",
            "descriptors[0](key=a, value=exact): ",
            "share_threshold needs a wildcard value",
        ],
    );
}

#[test]
fn bad_boolean() {
    one_error(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: maybe\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &["t.yaml:4:", "shadow_mode", "'maybe'"],
    );
}

#[test]
fn invalid_utf8_names_file_and_line() {
    let mut bytes = b"domain: d\ndescriptors:\n  - key: a\n    value: ".to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe]);
    bytes.extend_from_slice(b"\n");
    let e = compile_texts(&[("bin.yaml".into(), bytes)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bin.yaml:4:") && e.contains("not valid UTF-8"),
        "{e}"
    );
}

#[test]
fn every_problem_is_reported_not_only_the_first() {
    let yaml = "domain: d\nextra: 1\ndescriptors:\n  - key: a\n    rate_limit: {unit: weekly, requests_per_unit: 1}\n  - value: b\n  - key: c\n    quota_mode: maybe\n";
    let errs = errors("t.yaml", yaml);
    assert_eq!(errs.len(), 4, "{errs:#?}");
    assert!(errs.iter().any(|e| e.contains("'extra'")));
    assert!(errs.iter().any(|e| e.contains("bad unit 'weekly'")));
    assert!(errs.iter().any(|e| e.contains("without 'key'")));
    assert!(
        errs.iter()
            .any(|e| e.contains("quota_mode: expected true or false"))
    );
}

/// A text field holds its scalar as written: a plain `010`, `true` or `10`
/// is an integer or a boolean to the Go service, which it allows and
/// decodes as written. A plain `1.50` is a float, which it refuses, and is
/// refused; quoted, it is text and loads as written.
#[test]
fn scalars_are_literal_text_and_a_float_must_be_quoted() {
    let yaml = "domain: d\ndescriptors:\n  - key: a\n    value: 010\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: b\n    value: true\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: c\n    value: 10\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: e\n    value: \"1.50\"\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: f\n    value: '1.50'\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    let c = compile_texts(&[("t.yaml".into(), yaml.as_bytes().to_vec())]).expect("loads");
    let d = &c.domains["d"];
    for (k, v) in [
        ("a", "010"),
        ("b", "true"),
        ("c", "10"),
        ("e", "1.50"),
        ("f", "1.50"),
    ] {
        assert!(
            bucket_rls::matcher::find(&d.root, &[(k, v)]).is_some(),
            "{k}={v}"
        );
    }
    assert!(bucket_rls::matcher::find(&d.root, &[("a", "8")]).is_none());
    assert!(bucket_rls::matcher::find(&d.root, &[("e", "1.5")]).is_none());
    one_error(
        "t.yaml",
        &yaml.replace("value: \"1.50\"", "value: 1.50"),
        &[
            "t.yaml:13: descriptors[3](key=e, value=1.50): ",
            "value: '1.50' is a number (a float) to the Go service's YAML parser",
            "error checking config",
            "quote it to keep it as text: \"1.50\"",
        ],
    );
}

#[test]
fn directory_loads_configmap_layout_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let real = dir.path().join("..2024_01_01_00_00_00.1");
    std::fs::create_dir(&real).expect("mkdir");
    std::fs::write(real.join("rl.yaml"), "domain: k8s\ndescriptors: []\n").expect("write");
    std::fs::write(real.join("other.yml"), "domain: k8s2\ndescriptors: []\n").expect("write");
    std::os::unix::fs::symlink("..2024_01_01_00_00_00.1", dir.path().join("..data"))
        .expect("symlink");
    std::os::unix::fs::symlink("..data/rl.yaml", dir.path().join("rl.yaml")).expect("symlink");
    std::os::unix::fs::symlink("..data/other.yml", dir.path().join("other.yml")).expect("symlink");
    std::fs::write(dir.path().join("README.txt"), "not yaml").expect("write");
    std::fs::write(dir.path().join(".hidden.yaml"), "not: valid: yaml: [").expect("write");
    let c = load_source(dir.path()).expect("loads once, no duplicate domain");
    let mut names: Vec<_> = c.domains.keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["k8s", "k8s2"]);
}

/// Runs `load_source` on another thread and fails if it does not return in 5 s.
fn load_within_5s(p: &std::path::Path) -> Result<(), String> {
    let p = p.to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(load_source(&p).map(|_| ()).map_err(|e| e.to_string()));
    });
    rx.recv_timeout(std::time::Duration::from_secs(5))
        .expect("the loader must not block")
}

fn mkfifo(p: &std::path::Path) {
    let st = std::process::Command::new("mkfifo")
        .arg(p)
        .status()
        .expect("mkfifo");
    assert!(st.success());
}

#[test]
fn a_fifo_or_device_is_an_error_not_a_hang() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("rl.yaml");
    mkfifo(&fifo);
    let e = load_within_5s(&fifo).unwrap_err();
    assert!(
        e.contains("rl.yaml") && e.contains("not a regular file"),
        "{e}"
    );
    let e = load_within_5s(dir.path()).unwrap_err();
    assert!(
        e.contains("rl.yaml") && e.contains("not a regular file"),
        "{e}"
    );
    let zero = dir.path().join("zero.yaml");
    std::fs::remove_file(&fifo).expect("rm");
    std::os::unix::fs::symlink("/dev/zero", &zero).expect("symlink");
    let e = load_within_5s(&zero).unwrap_err();
    assert!(
        e.contains("zero.yaml") && e.contains("not a regular file"),
        "{e}"
    );
}

#[test]
fn a_dangling_yaml_symlink_is_an_error_not_a_missing_domain() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("a.yaml"), "domain: a\ndescriptors: []\n").expect("write");
    std::os::unix::fs::symlink(dir.path().join("gone.yaml"), dir.path().join("edge.yaml"))
        .expect("symlink");
    let e = load_within_5s(dir.path()).unwrap_err();
    assert!(e.contains("edge.yaml") && e.contains("cannot read"), "{e}");
}

/// A file that cannot be read does not hide the problems of the others:
/// every problem of the directory is reported at once.
#[test]
fn an_unreadable_file_does_not_hide_other_problems() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(dir.path().join("gone.yaml"), dir.path().join("a.yaml"))
        .expect("symlink");
    std::fs::write(
        dir.path().join("b.yaml"),
        "domain: b\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    )
    .expect("write");
    std::fs::write(dir.path().join("c.yaml"), "domain: c\ndescriptors: []\n").expect("write");
    std::fs::write(dir.path().join("d.yaml"), "domain: c\ndescriptors: []\n").expect("write");
    let e = load_within_5s(dir.path()).unwrap_err();
    assert!(e.contains("a.yaml") && e.contains("cannot read"), "{e}");
    assert!(e.contains("b.yaml:4") && e.contains("fortnight"), "{e}");
    assert!(
        e.contains("d.yaml") && e.contains("duplicate domain"),
        "{e}"
    );
}

#[test]
fn domain_with_surrounding_spaces_is_an_error() {
    one_error(
        "t.yaml",
        "domain: \" edge \"\ndescriptors: []\n",
        &["t.yaml:1:", "domain", "leading or trailing whitespace"],
    );
}

#[test]
fn missing_source_is_an_error() {
    let e = load_source(std::path::Path::new("/nonexistent/bucket-rls.yaml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/nonexistent/bucket-rls.yaml") && e.contains("cannot read"),
        "{e}"
    );
}

#[test]
fn example_config_is_valid() {
    let c = load_source(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/example.yaml"
    )))
    .expect("example loads");
    assert_eq!(c.rule_count(), 6);
}

// Configs written the way the Go reference service's own examples and tests
// write them (in our words, same keys): each one it loads loads here, each
// one it refuses is refused.

use bucket_rls::config::compile::{LoadOptions, compile_texts_with};

fn loads(yaml: &str) -> bucket_rls::config::Config {
    compile_texts(&[("go.yaml".into(), yaml.as_bytes().to_vec())])
        .unwrap_or_else(|e| panic!("must load:\n{yaml}\n{e}"))
}

#[test]
fn the_go_example_shapes_load_with_their_meaning() {
    let c = loads(
        "---
domain: edge
descriptors:
  - key: tier
    value: partner
    rate_limit:
      replaces: [{name: vip}, {name: spare}]
      unit: minute
      requests_per_unit: 4
  - key: origin
    value: gateway
    descriptors:
      - key: target
        value: vip
        rate_limit: {replaces: [{name: vip}], unit: minute, requests_per_unit: 2}
      - key: target
        value: spare
        rate_limit: {name: spare, unit: minute, requests_per_unit: 2}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 2}
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 3}
      - key: user
        value: vip
        rate_limit: {name: vip, unit: minute, requests_per_unit: 1}
      - key: user
        value: blocked
        rate_limit: {unit: minute, requests_per_unit: 0}
      - key: region
        value: trial
        rate_limit: {unit: minute, requests_per_unit: 3}
        shadow_mode: true
      - key: free
        rate_limit: {unlimited: true}
  - key: anon
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: backend
    value: b1
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata:
      backend_with_quota:
        name: \"b1\"
  - key: backend
    value: b2
    quota_mode: false
    value_to_metric: false
    rate_limit: {unit: minute, requests_per_unit: 2}
    metadata: {backend_with_quota: {name: b2, weight: 2, tags: [a, b], on: true}}
  - key: leaf_without_limit
    value: x
",
    );
    let d = &c.domains["edge"];
    let rule = |path: &str| {
        d.rules
            .iter()
            .find(|r| r.path == path)
            .unwrap_or_else(|| panic!("{path}"))
    };
    let b1 = rule("edge.backend_b1");
    assert!(b1.quota_mode);
    assert_eq!(
        serde_json::Value::Object(b1.metadata.as_deref().unwrap().clone()),
        serde_json::json!({"backend_with_quota": {"name": "b1"}})
    );
    let b2 = rule("edge.backend_b2");
    assert!(!b2.quota_mode && b2.metric_levels.is_none());
    assert_eq!(
        serde_json::Value::Object(b2.metadata.as_deref().unwrap().clone()),
        serde_json::json!({"backend_with_quota": {"name": "b2", "weight": 2, "tags": ["a", "b"], "on": true}})
    );
    assert!(rule("edge.path.region_trial").shadow_mode);
}

#[test]
fn share_threshold_with_value_to_metric_and_detailed_metric_loads() {
    let c = loads(
        "domain: st
descriptors:
  - key: route
    value: api/*
    share_threshold: true
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 60}
  - key: svc
    value: svc/*
    share_threshold: true
    descriptors:
      - key: endpoint
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 80}
  - key: user
    value: user/*
    share_threshold: true
    descriptors:
      - key: resource
        value: res/*
        share_threshold: true
        descriptors:
          - key: action
            value_to_metric: true
            rate_limit: {unit: minute, requests_per_unit: 150}
  - key: mid
    value: /api*v2
    share_threshold: true
    value_to_metric: true
    rate_limit: {unit: minute, requests_per_unit: 80}
",
    );
    let d = &c.domains["st"];
    let with_levels = d.rules.iter().filter(|r| r.metric_levels.is_some()).count();
    assert_eq!(with_levels, 3, "route/method, user/resource/action and mid");
}

#[test]
fn the_go_service_refusals_are_refused() {
    for (yaml, needle) in [
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {unit: fortnight, requests_per_unit: 5}\n",
            "bad unit 'fortnight'",
        ),
        ("'''\n", "invalid YAML"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    value: v\n",
            "duplicate descriptor composite key",
        ),
        ("descriptors:\n", "domain"),
        ("domain: d\ndescriptors:\n  - value: v\n", "without 'key'"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    ratelimit: {unit: day, requests_per_unit: 5}\n",
            "unknown key 'ratelimit'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requestsperunit: 5}\n",
            "unknown key 'requestsperunit'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      name: me\n      replaces:\n        - name:\n      unit: second\n      requests_per_unit: 5\n",
            "non-empty 'name'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {name: me, replaces: [{name: me}], unit: second, requests_per_unit: 5}\n",
            "replaces itself",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: day, requests_per_unit: 25}\n",
            "must not be given with 'unlimited: true'",
        ),
        (
            "0.25: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 5}\n",
            "'0.25'",
        ),
        ("domain: d\ndescriptors:\n  - a\n  - b\n", "wrong type"),
    ] {
        let errs = errors("go.yaml", yaml);
        assert!(
            errs.iter().any(|e| e.contains(needle)),
            "{yaml:?}: {errs:#?} lacks {needle:?}"
        );
    }
}

#[test]
fn files_of_one_domain_merge_only_when_asked() {
    let a = "domain: shared\ndescriptors:\n  - key: k1\n    value: v1\n    rate_limit: {unit: minute, requests_per_unit: 10}\n";
    let b = "domain: shared\ndescriptors:\n  - key: k2\n    value: v2\n    rate_limit: {unit: minute, requests_per_unit: 20}\n";
    let texts = vec![
        ("a.yaml".to_owned(), a.as_bytes().to_vec()),
        ("b.yaml".to_owned(), b.as_bytes().to_vec()),
    ];
    let e = compile_texts(&texts).unwrap_err().to_string();
    assert!(e.contains("duplicate domain 'shared'"), "{e}");
    let merge = LoadOptions {
        merge_domains: true,
        ..LoadOptions::default()
    };
    let c = compile_texts_with(&texts, merge).unwrap();
    let d = &c.domains["shared"];
    let paths: Vec<&str> = d.rules.iter().map(|r| r.path.as_str()).collect();
    assert_eq!(paths, ["shared.k1_v1", "shared.k2_v2"]);
    assert_eq!(d.file, "a.yaml, b.yaml");
    // Both rules match after the merge (rule indices of the second file moved).
    let m = bucket_rls::matcher::find(&d.root, &[("k2", "v2")]).unwrap();
    assert_eq!(d.rules[m.rule].path, "shared.k2_v2");
    // The same top-level descriptor in both files is still refused, naming both.
    let twice = vec![
        ("a.yaml".to_owned(), a.as_bytes().to_vec()),
        ("c.yaml".to_owned(), a.as_bytes().to_vec()),
    ];
    let e = compile_texts_with(&twice, merge).unwrap_err().to_string();
    assert!(
        e.contains("c.yaml:3: descriptors: duplicate descriptor composite key 'shared.k1_v1' (first defined at a.yaml:3)"),
        "{e}"
    );
}

/// Many files each under the per-file cap cannot add up to unbounded parse
/// memory: past 64 MiB in all, the remaining files are errors and the source
/// does not load (a running service keeps its config).
#[test]
fn files_past_the_source_size_cap_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let padding = format!("# {}\n", "x".repeat(1022)).repeat(22 * 1024); // 22 MiB
    for i in 0..3 {
        std::fs::write(
            dir.path().join(format!("d{i}.yaml")),
            format!("domain: d{i}\ndescriptors: []\n{padding}"),
        )
        .unwrap();
    }
    let e = load_source(dir.path()).expect_err("66 MiB in all");
    let text = e.to_string();
    assert!(text.contains("d2.yaml"), "{text}");
    assert!(text.contains("config source is too large"), "{text}");
    assert_eq!(e.0.len(), 1, "only the file past the cap: {text}");
}

/// `rate_limit.algorithm` names the algorithm; a window refuses the token
/// bucket's `burst` and `max_debt` (also when it is a window by the
/// service's default algorithm), an unknown name and `algorithm` beside
/// `unlimited: true` are refused; every error names the file, the line and
/// the path.
#[test]
fn window_rules_refuse_bucket_settings_with_file_line_and_path() {
    use bucket_rls::config::Policy;
    use bucket_rls::config::compile::{LoadOptions, compile_texts_with};
    use bucket_rls::storage::AlgorithmKind;
    let rule = |rl: &str| {
        format!(
            "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit:\n          {rl}\n"
        )
    };
    let path = "descriptors[0](key=a).descriptors[0](key=b).rate_limit";
    for (rl, needle) in [
        (
            "{unit: hour, requests_per_unit: 5, algorithm: fixed_window, burst: 10}",
            "'burst' is a token bucket setting: this rule is a window, by 'algorithm: fixed_window'",
        ),
        (
            "{unit: hour, requests_per_unit: 5, algorithm: fixed_window, max_debt: 10}",
            "'max_debt' is a token bucket setting: this rule is a window, by 'algorithm: fixed_window'",
        ),
        (
            "{unit: hour, requests_per_unit: 5, algorithm: sliding_window, burst: 10}",
            "'burst' is a token bucket setting: this rule is a window, by 'algorithm: sliding_window'",
        ),
        (
            "{unit: hour, requests_per_unit: 5, algorithm: leaky_bucket}",
            "bad algorithm 'leaky_bucket': expected token_bucket, fixed_window, sliding_window",
        ),
        (
            "{unlimited: true, algorithm: fixed_window}",
            "'algorithm' must not be given with 'unlimited: true'",
        ),
    ] {
        one_error("t.yaml", &rule(rl), &["t.yaml:7:", path, needle]);
    }
    // A misspelt key is a near miss of `algorithm`.
    one_error(
        "t.yaml",
        &rule("{unit: hour, requests_per_unit: 5, algoritm: fixed_window}"),
        &["t.yaml:7:", path, "did you mean 'algorithm'?"],
    );
    // Under --default-algorithm fixed_window a rule naming none is a
    // window: its burst is refused, saying so; naming the bucket loads.
    let fixed = LoadOptions {
        default_algorithm: AlgorithmKind::FixedWindow,
        ..LoadOptions::default()
    };
    let texts = |rl: &str| vec![("t.yaml".to_owned(), rule(rl).into_bytes())];
    let e = compile_texts_with(
        &texts("{unit: hour, requests_per_unit: 5, burst: 10}"),
        fixed,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("t.yaml:7:")
            && e.contains(path)
            && e.contains("by the default algorithm fixed_window (--default-algorithm)")
            && e.contains("add 'algorithm: token_bucket'"),
        "{e}"
    );
    let algorithm_of = |c: &bucket_rls::config::Config| match c.domains["d"].rules[0].policy {
        Policy::Limited { algorithm, .. } => algorithm,
        Policy::Unlimited => panic!("limited"),
    };
    let c = compile_texts_with(
        &texts("{unit: hour, requests_per_unit: 5, burst: 10, algorithm: token_bucket}"),
        fixed,
    )
    .expect("an explicit bucket loads");
    assert_eq!(algorithm_of(&c), AlgorithmKind::TokenBucket);
    let c = compile_texts_with(&texts("{unit: hour, requests_per_unit: 5}"), fixed).expect("loads");
    assert_eq!(algorithm_of(&c), AlgorithmKind::FixedWindow);
    let c = compile_texts(&texts("{unit: hour, requests_per_unit: 5}")).expect("loads");
    assert_eq!(algorithm_of(&c), AlgorithmKind::TokenBucket, "the default");
}

/// A `reservation` is checked where it is written: it needs a token
/// bucket rule on the same descriptor, a key-only entry that ends its
/// path, a TTL within bounds and a `max_open` within bounds; each error
/// names the file, line and descriptor path.
#[test]
fn bad_reservations_are_refused_with_file_line_and_path() {
    let file = |entry: &str| {
        format!("domain: llm\ndescriptors:\n  - key: user\n    descriptors:\n{entry}")
    };
    let path = "descriptors[0](key=user).descriptors[0](key=request_id).reservation";
    for (entry, needle) in [
        (
            "      - key: request_id\n        reservation: {ttl_seconds: 60}\n        rate_limit: {unit: hour, requests_per_unit: 10, algorithm: fixed_window}\n",
            "a reservation needs a token bucket rule, and this rule is a fixed_window",
        ),
        (
            "      - key: request_id\n        reservation: {ttl_seconds: 60}\n        rate_limit: {unlimited: true}\n",
            "this rule is 'unlimited: true'",
        ),
        (
            "      - key: request_id\n        reservation: {ttl_seconds: 60}\n",
            "a reservation needs a rate_limit on the same descriptor",
        ),
        (
            "      - key: request_id\n        reservation: {ttl_seconds: 0}\n        rate_limit: {unit: hour, requests_per_unit: 10}\n",
            "ttl_seconds must be between 1 and 604800 (one week), got 0",
        ),
        (
            "      - key: request_id\n        reservation: {ttl_seconds: 604801}\n        rate_limit: {unit: hour, requests_per_unit: 10}\n",
            "ttl_seconds must be between 1 and 604800",
        ),
        (
            "      - key: request_id\n        reservation: {max_open: 5}\n        rate_limit: {unit: hour, requests_per_unit: 10}\n",
            "missing 'ttl_seconds'",
        ),
        (
            "      - key: request_id\n        reservation: {ttl_seconds: 60, max_open: 0}\n        rate_limit: {unit: hour, requests_per_unit: 10}\n",
            "max_open must be between 1 and 100000, got 0",
        ),
        (
            "      - key: request_id\n        reservation: {ttl_seconds: 60, max_opn: 3}\n        rate_limit: {unit: hour, requests_per_unit: 10}\n",
            "unknown key 'max_opn': did you mean 'max_open'?",
        ),
        (
            "      - key: request_id\n        reservation: {ttl_seconds: 60}\n        rate_limit: {unit: hour, requests_per_unit: 10}\n        descriptors:\n          - key: x\n            rate_limit: {unit: hour, requests_per_unit: 1}\n",
            "a reservation entry must end its path",
        ),
    ] {
        let e = one_error("llm.yaml", &file(entry), &[needle, path]);
        assert!(e.starts_with("llm.yaml:6:"), "{e}");
    }
    // A value: the entry would not carry each request's id.
    one_error(
        "llm.yaml",
        &file(
            "      - key: request_id\n        value: fixed\n        reservation: {ttl_seconds: 60}\n        rate_limit: {unit: hour, requests_per_unit: 10}\n",
        ),
        &[
            "llm.yaml:7:",
            "descriptors[0](key=user).descriptors[0](key=request_id, value=fixed).reservation",
            "a reservation entry must be key-only",
        ],
    );
}
