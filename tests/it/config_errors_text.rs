//! Text fields (`domain`, `key`, `value`, a rule's `name`, a `replaces`
//! name) written as plain scalars that the Go service's YAML 1.1 parser
//! reads as floats: its check of the values before decoding refuses the
//! file ("error checking config"), and so does bucket-rls, naming the
//! file, the line and the descriptor path, and saying to quote the text.

use super::config_errors::{errors, one_error};
use bucket_rls::config::compile::compile_texts;

const RATE: &str = "    rate_limit: {unit: second, requests_per_unit: 1}\n";

/// Each float form in a `value` (block and flow style) and in a `key`.
#[test]
fn each_float_form_in_a_key_or_value_is_refused_with_file_line_and_path() {
    for literal in [
        "1.50", "09", ".5", ".inf", ".nan", "1e3", "-.INF", "1_000.5",
    ] {
        let block = format!("domain: d\ndescriptors:\n  - key: k\n    value: {literal}\n{RATE}");
        one_error(
            "t.yaml",
            &block,
            &[
                &format!(
                    "t.yaml:4: descriptors[0](key=k, value={literal}): value: '{literal}' is a number (a float) to the Go service's YAML parser"
                ),
                "error checking config",
                &format!("quote it to keep it as text: \"{literal}\""),
            ],
        );
        let flow = format!("domain: d\ndescriptors:\n  - {{key: k, value: {literal}}}\n");
        one_error(
            "t.yaml",
            &flow,
            &[
                &format!("t.yaml:3: descriptors[0](key=k, value={literal}): value: '{literal}'"),
                "error checking config",
            ],
        );
        let key = format!("domain: d\ndescriptors:\n  - key: {literal}\n{RATE}");
        one_error(
            "t.yaml",
            &key,
            &[
                &format!(
                    "t.yaml:3: descriptors[0](key={literal}): key: '{literal}' is a number (a float)"
                ),
                "error checking config",
            ],
        );
    }
}

/// The nested path is named, and every such field of the file is reported.
#[test]
fn every_float_text_field_is_reported_with_its_path() {
    let yaml = "domain: 1.5\ndescriptors:\n  - key: k\n    descriptors:\n      - key: n\n        value: 09\n        rate_limit: {unit: second, requests_per_unit: 1, name: 2.0}\n      - key: m\n        value: v\n        replaces: [{name: 1e3}]\n        rate_limit: {unit: second, requests_per_unit: 1}\n";
    let errs = errors("t.yaml", yaml);
    for needle in [
        "t.yaml:1: domain: '1.5' is a number (a float)",
        "t.yaml:6: descriptors[0](key=k).descriptors[0](key=n, value=09): value: '09' is a number (a float)",
        "t.yaml:7: descriptors[0](key=k).descriptors[0](key=n, value=09).rate_limit: name: '2.0' is a number (a float)",
        "t.yaml:10: descriptors[0](key=k).descriptors[1](key=m, value=v).replaces[0]: name: '1e3' is a number (a float)",
    ] {
        assert!(
            errs.iter().any(|e| e.starts_with(needle)),
            "{needle}: {errs:#?}"
        );
    }
    assert_eq!(errs.len(), 4, "{errs:#?}");
}

/// Quoted, block and `!!str` scalars are text to the Go service and load
/// as written, as do a float through an alias of a quoted anchor and text
/// that only looks numeric (`1e999` is beyond a float: text to yaml.v2).
#[test]
fn quoted_block_and_tagged_float_text_loads_as_written() {
    let yaml = "domain: \"1.5\"\ndescriptors:\n  - key: '1e3'\n    value: \"1.50\"\n    rate_limit: {unit: second, requests_per_unit: 1, name: '2.0'}\n  - key: b\n    value: |-\n      .5\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: c\n    value: !!str .inf\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: d\n    value: &q \"09\"\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: e\n    value: *q\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: f\n    value: 1e999\n    replaces: [{name: \"2.0\"}]\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    let c = compile_texts(&[("t.yaml".into(), yaml.as_bytes().to_vec())])
        .unwrap_or_else(|e| panic!("loads: {e}"));
    let d = &c.domains["1.5"];
    for (k, v) in [
        ("1e3", "1.50"),
        ("b", ".5"),
        ("c", ".inf"),
        ("d", "09"),
        ("e", "09"),
        ("f", "1e999"),
    ] {
        assert!(
            bucket_rls::matcher::find(&d.root, &[(k, v)]).is_some(),
            "{k}={v}"
        );
    }
    assert!(d.rules.iter().any(|r| r.name.as_deref() == Some("2.0")));
}

/// A plain float reached through an alias is refused at its anchor's line.
#[test]
fn a_float_through_an_alias_is_refused() {
    let yaml = "domain: d\ndescriptors:\n  - key: a\n    value: &v 1.50\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: b\n    value: *v\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    let errs = errors("t.yaml", yaml);
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert!(
        errs.iter()
            .all(|e| e.contains("value: '1.50' is a number (a float)")),
        "{errs:#?}"
    );
}

/// An integer the Go service reads as an unsigned 64-bit one (above its
/// `int`) fails the same check; one that fits loads as written.
#[test]
fn an_integer_above_the_go_int_is_refused_and_one_within_loads() {
    one_error(
        "t.yaml",
        &format!("domain: d\ndescriptors:\n  - key: k\n    value: 18446744073709551615\n{RATE}"),
        &[
            "t.yaml:4: descriptors[0](key=k, value=18446744073709551615): value: '18446744073709551615' is a number (an unsigned integer above 9223372036854775807)",
            "error checking config",
        ],
    );
    let yaml =
        format!("domain: d\ndescriptors:\n  - key: k\n    value: 9223372036854775807\n{RATE}");
    let c = compile_texts(&[("t.yaml".into(), yaml.into_bytes())])
        .unwrap_or_else(|e| panic!("loads: {e}"));
    assert!(
        bucket_rls::matcher::find(&c.domains["d"].root, &[("k", "9223372036854775807")]).is_some()
    );
}
