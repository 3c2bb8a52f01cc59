//! Numbers and booleans in config files, read as the Go reference service
//! reads them.
//!
//! The Go service (envoyproxy/ratelimit) decodes its YAML with
//! `gopkg.in/yaml.v2`, a YAML 1.1 reader: a plain `010` is octal 8, `0x10`
//! is 16, `1_000` is 1000, a quoted `"10"` is a string that an integer field
//! refuses, and `yes`, `on` and `y` are booleans. Before decoding, it reads
//! the whole file into generic maps and refuses any value that is neither a
//! string, an integer, a boolean nor a null ("error checking config"), so a
//! scalar YAML 1.1 reads as a float (`09`, which is not octal, `1e3`,
//! `10.0`, `10.5`) fails the file. A reader of the file (and YAML 1.2 tools)
//! sees `010` as ten. [`read_u32`] and [`read_bool`] accept a scalar only
//! where the Go service accepts it with the same meaning a reader sees, and
//! refuse, with both readings named, where the two differ.
//! docs/go-compatibility.md ("Numbers and booleans") has the table.
//!
//! The same check of the values applies to text fields (`domain`, `key`,
//! `value`, a rule's `name`): a plain `value: 1.50` is a float to the Go
//! service, which refuses the file, while a plain `010`, `10` or `true`
//! is an integer or a boolean, which it allows and decodes into the text
//! field as written. [`check_plain_text`] tells the two apart.

use std::collections::HashSet;

/// Reads an unsigned 32-bit integer field (`requests_per_unit`, `burst`,
/// `max_debt`) from its literal text. `quoted` is whether the scalar was
/// written in quotes (a string to the Go service).
///
/// Accepted: decimal integers (`10`, `+10`, `1_000`), a leading zero whose
/// octal and decimal readings agree (`00`, `07`), and `0x`, `0o` and `0b`
/// integers, all from 0 to 4,294,967,295.
///
/// # Errors
/// A message (without the field's name) when the Go service refuses the
/// scalar (quoted, not a number, a float such as `09`, `1e3` or `10.0`,
/// negative, above 4,294,967,295), or when it reads a different number
/// than the decimal digits say (`010`: octal 8, not 10).
pub fn read_u32(literal: &str, quoted: bool) -> Result<u32, String> {
    if quoted {
        return Err(format!(
            "expected a number, got the quoted string \"{literal}\" (the Go service refuses a \
             string here; write it without quotes)"
        ));
    }
    let text = literal.trim();
    let plain: String = text.chars().filter(|&c| c != '_').collect();
    let not_a_number = || format!("expected an integer from 0 to 4294967295, got '{literal}'");
    match go_number(&plain) {
        None => Err(not_a_number()),
        Some(GoNumber::Int(v)) => {
            let v = u32::try_from(v).map_err(|_| not_a_number())?;
            // A leading zero followed by decimal digits: octal to the Go
            // service, decimal to a reader.
            let digits = plain.trim_start_matches(['+', '-']);
            if digits.len() > 1
                && digits.starts_with('0')
                && digits.bytes().all(|b| b.is_ascii_digit())
            {
                let decimal: u128 = digits.parse().unwrap_or(u128::MAX);
                if decimal != u128::from(v) {
                    return Err(format!(
                        "'{literal}' has a leading zero: the Go service's YAML parser (YAML 1.1) \
                         reads it as octal {v}, a decimal reading gives {decimal}; write {v} or \
                         {decimal} without the leading zero"
                    ));
                }
            }
            Ok(v)
        }
        // The Go service refuses the file at its first check of the values
        // ("error checking config"), before any field is decoded.
        Some(GoNumber::Float) => Err(format!(
            "expected an integer from 0 to 4294967295, got '{literal}', a float to the Go \
             service's YAML parser (YAML 1.1), which refuses the file (\"error checking \
             config\"); write the integer without a leading zero, a fraction or an exponent"
        )),
    }
}

/// Reads a boolean field (`unlimited`, `shadow_mode`, ...) from its literal
/// text. `quoted` is whether the scalar was written in quotes.
///
/// Accepted, as YAML 1.1 and the Go service: `true`, `yes`, `on`, `y` and
/// `false`, `no`, `off`, `n`, each in lower case, capitalised or upper
/// case; a null (`~`, `null`, nothing) is false.
///
/// # Errors
/// A message (without the field's name) for a quoted scalar or any other
/// text, both of which the Go service refuses.
pub fn read_bool(literal: &str, quoted: bool) -> Result<bool, String> {
    if quoted {
        return Err(format!(
            "expected true or false, got the quoted string \"{literal}\" (the Go service \
             refuses a string here; write it without quotes)"
        ));
    }
    let text = literal.trim();
    let spelled = |words: &[&str]| {
        words.iter().any(|w| {
            let mut capital = w.to_string();
            capital[..1].make_ascii_uppercase();
            text == *w || text == capital || text == w.to_ascii_uppercase()
        })
    };
    if spelled(&["true", "yes", "on", "y"]) {
        Ok(true)
    } else if spelled(&["false", "no", "off", "n", "null"]) || text.is_empty() || text == "~" {
        Ok(false)
    } else {
        Err(format!("expected true or false, got '{literal}'"))
    }
}

/// Checks a text field (`domain`, `key`, `value`, a rule's `name`) written
/// as the plain, untagged scalar `literal` (the caller knows the style:
/// quoted, block and tagged scalars are strings to the Go service).
///
/// Accepted: whatever yaml.v2 2.4.0 reads as a string, a boolean, a null
/// or an integer that fits Go's `int` (64 bits): the Go service's check of
/// the values allows these, and decodes the literal text into the field.
///
/// # Errors
/// A message (without the field's name) when yaml.v2 reads the scalar as
/// a float (`1.50`, `09`, `1e3`, `.5`, `.inf`, `.nan`) or as an unsigned
/// integer above 9,223,372,036,854,775,807, both of which the Go service's
/// check of the values refuses ("error checking config").
pub fn check_plain_text(literal: &str) -> Result<(), String> {
    let what = match go_plain_kind(literal) {
        GoPlain::Allowed => return Ok(()),
        GoPlain::Float => "a number (a float)",
        GoPlain::Uint64 => "a number (an unsigned integer above 9223372036854775807)",
    };
    Err(format!(
        "'{literal}' is {what} to the Go service's YAML parser (YAML 1.1), which refuses the \
         file (\"error checking config\"); quote it to keep it as text: \"{literal}\""
    ))
}

/// The byte offsets where `source` (a whole YAML file) has a plain,
/// untagged scalar that [`check_plain_text`] refuses: the scalars to refuse
/// in a text field, told apart from the same text quoted, in a block or
/// tagged (`!!str 1.50`), which the Go service reads as a string. Empty for
/// text the YAML parser refuses (the file has been parsed before).
#[must_use]
pub fn refused_plain_scalars(source: &str) -> HashSet<usize> {
    use serde_saphyr::granit_parser::{Event, Parser, ScalarStyle};
    let mut out = HashSet::new();
    for event in Parser::new_from_str(source) {
        let Ok((event, span)) = event else { break };
        if let Event::Scalar(text, ScalarStyle::Plain, _, None) = event
            && check_plain_text(&text).is_err()
            && let Some(offset) = span.start.byte_offset()
        {
            out.insert(offset);
        }
    }
    out
}

/// What yaml.v2 2.4.0 resolves a plain, untagged scalar to, as far as the
/// Go service's check of the values goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GoPlain {
    /// A string, a boolean, a null or an integer that fits an `int`.
    Allowed,
    /// A float (refused).
    Float,
    /// An integer that only fits a `uint64` (refused).
    Uint64,
}

/// yaml.v2's `resolve` for a plain scalar: a float by its table (`.inf`,
/// `.nan` and their spellings); a float by Go's `ParseFloat` when the text
/// starts with `.`; when it starts with a digit or a sign, with its
/// underscores removed, an `int`, else a `uint64`, else a float by YAML
/// 1.1's float syntax; a string otherwise (a float out of range included:
/// `ParseFloat` fails on it).
fn go_plain_kind(literal: &str) -> GoPlain {
    const FLOATS: &[&str] = &[
        ".nan", ".NaN", ".NAN", ".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF", "-.inf",
        "-.Inf", "-.INF",
    ];
    if FLOATS.contains(&literal) {
        return GoPlain::Float;
    }
    match literal.as_bytes().first() {
        Some(b'.') => {
            // Go's float syntax: an underscore only between two digits.
            let b = literal.as_bytes();
            let separators_ok = b.iter().enumerate().all(|(i, &c)| {
                c != b'_'
                    || (i > 0
                        && b[i - 1].is_ascii_digit()
                        && b.get(i + 1).is_some_and(u8::is_ascii_digit))
            });
            let plain: String = literal.chars().filter(|&c| c != '_').collect();
            if separators_ok && yaml_float(&plain).is_some() {
                GoPlain::Float
            } else {
                GoPlain::Allowed
            }
        }
        Some(b'0'..=b'9' | b'+' | b'-') => {
            let plain: String = literal.chars().filter(|&c| c != '_').collect();
            match go_parse_int(&plain) {
                Some(v) if i64::try_from(v).is_ok() => GoPlain::Allowed,
                Some(v) if !plain.starts_with(['+', '-']) && u64::try_from(v).is_ok() => {
                    GoPlain::Uint64
                }
                _ if yaml_float(&plain).is_some() => GoPlain::Float,
                _ => GoPlain::Allowed,
            }
        }
        _ => GoPlain::Allowed,
    }
}

/// Go's `strconv.ParseInt(s, 0, _)` syntax (a sign, then `0x`, `0o`, `0b`
/// or a bare leading `0` for octal), without its range check: the value,
/// or `None` when the text is not an integer or is beyond 128 bits.
fn go_parse_int(s: &str) -> Option<i128> {
    let (negative, body) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let lower = body.to_ascii_lowercase();
    let (radix, digits) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d)
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d)
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let v = i128::from_str_radix(digits, radix).ok()?;
    Some(if negative { -v } else { v })
}

/// A plain scalar the Go service reads as a number.
#[derive(Debug, Clone, Copy, PartialEq)]
enum GoNumber {
    /// An integer (any sign and size an unsigned field could be asked to hold).
    Int(i128),
    /// A float (which the Go service refuses in a config file).
    Float,
}

/// How yaml.v2 resolves a plain scalar with its underscores removed, as far
/// as numbers go: Go's integer syntax with a base prefix (`0x`, `0o`, `0b`,
/// or a bare leading `0` for octal), then YAML's float syntax. `None` for
/// anything else (a string to it).
fn go_number(plain: &str) -> Option<GoNumber> {
    if let Some(v) = go_parse_int(plain) {
        return Some(GoNumber::Int(v));
    }
    yaml_float(plain).map(|_| GoNumber::Float)
}

/// YAML 1.1's float syntax as yaml.v2 checks it
/// (`[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?`), parsed; `None`
/// also beyond the largest float (`1e999`), where Go's `ParseFloat` fails
/// and yaml.v2 reads the scalar as a string.
fn yaml_float(s: &str) -> Option<f64> {
    let b = s.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let digits = |i: &mut usize| {
        let start = *i;
        while b.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i - start
    };
    if b.get(i) == Some(&b'.') {
        i += 1;
        if digits(&mut i) == 0 {
            return None;
        }
    } else {
        if digits(&mut i) == 0 {
            return None;
        }
        if b.get(i) == Some(&b'.') {
            i += 1;
            digits(&mut i);
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return None;
        }
    }
    if i != b.len() {
        return None;
    }
    s.parse().ok().filter(|f: &f64| f.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each literal with what bucket-rls makes of it: the value yaml.v2
    /// 2.4.0 decodes into a `uint32` where the Go service loads the file
    /// (an integer whose readings agree), `None` where it refuses the file
    /// (a float: its check of the values before decoding) or reads another
    /// number than a reader.
    #[test]
    fn integers_load_only_where_the_go_reading_and_the_decimal_reading_agree() {
        for (literal, expected) in [
            ("10", Some(10)),
            ("+10", Some(10)),
            ("1_000", Some(1000)),
            ("9_9", Some(99)),
            ("0", Some(0)),
            ("00", Some(0)),
            ("007", Some(7)),
            ("09", None),
            ("08", None),
            ("0x10", Some(16)),
            ("0o10", Some(8)),
            ("0b10", Some(2)),
            ("1e3", None),
            ("1.0", None),
            ("010.0", None),
            ("4294967295", Some(u32::MAX)),
            ("017777777777", None),
            ("010", None),
            ("0100", None),
            ("0_10", None),
            ("+010", None),
            ("0777", None),
            ("10.5", None),
            ("0.5", None),
            ("4294967296", None),
            ("-1", None),
            ("0x", None),
            ("0b", None),
            ("1:00", None),
            ("ten", None),
            ("", None),
        ] {
            assert_eq!(read_u32(literal, false).ok(), expected, "{literal:?}");
        }
    }

    #[test]
    fn a_leading_zero_names_both_readings() {
        let e = read_u32("010", false).unwrap_err();
        assert!(e.contains("octal 8") && e.contains("gives 10"), "{e}");
        let e = read_u32("0100", false).unwrap_err();
        assert!(e.contains("octal 64") && e.contains("gives 100"), "{e}");
    }

    /// A float is refused whole or not, as the Go service refuses the file.
    #[test]
    fn a_float_is_refused_naming_the_go_services_refusal() {
        for literal in ["09", "1e3", "10.0", "10.5", ".5"] {
            let e = read_u32(literal, false).unwrap_err();
            assert!(
                e.contains(&format!("got '{literal}', a float"))
                    && e.contains("error checking config"),
                "{e}"
            );
        }
    }

    /// Plain text fields as yaml.v2 2.4.0 resolves them: refused where its
    /// value is a float or a `uint64` (the Go service's check of the values
    /// refuses both), loaded where it is a string, a boolean, a null or an
    /// integer that fits Go's 64-bit `int`.
    #[test]
    fn plain_text_is_refused_only_where_the_go_service_reads_a_refused_number() {
        for refused in [
            "1.50",
            "09",
            "08",
            "1e3",
            "1E3",
            ".5",
            "+.5",
            "-1.5",
            "1.",
            "1_000.5",
            ".5_0",
            ".inf",
            ".Inf",
            "-.INF",
            "+.inf",
            ".nan",
            ".NaN",
            "010.0",
            "99999999999999999999",
            "-9223372036854775809",
            "+9223372036854775808",
            "9223372036854775808",
            "18446744073709551615",
            "0x8000000000000000",
        ] {
            let e = check_plain_text(refused).unwrap_err();
            assert!(
                e.contains(&format!("'{refused}' is a number"))
                    && e.contains("error checking config")
                    && e.contains(&format!("\"{refused}\"")),
                "{e}"
            );
        }
        for allowed in [
            "10",
            "010",
            "0x10",
            "-1",
            "1_000",
            "9223372036854775807",
            "-9223372036854775808",
            "true",
            "yes",
            "",
            "~",
            "a.b",
            "1.2.3",
            "1e",
            "._5",
            ".",
            ".iNf",
            "+.nan",
            "_1.5",
            "1e999",
            "0x1_0000_0000_0000_0000",
            "2001-12-14",
            "10.0.0.1",
            "v1.5",
        ] {
            assert_eq!(check_plain_text(allowed), Ok(()), "{allowed:?}");
        }
    }

    /// Only plain, untagged scalars are refused: quoted, block and `!!str`
    /// scalars are strings to the Go service.
    #[test]
    fn only_plain_untagged_scalars_are_found() {
        let source = "a: 1.5\nb: \"1.5\"\nc: '1.5'\nd: |-\n  1.5\ne: !!str 1.5\nf: &x 1.5\ng: *x\nh: [1.5]\ni: 10\n";
        let mut found: Vec<usize> = refused_plain_scalars(source).into_iter().collect();
        found.sort_unstable();
        let at = |needle: &str| source.find(needle).expect("in source");
        assert_eq!(found, [at("1.5\nb"), at("1.5\ng"), at("1.5]")], "{source}");
    }

    #[test]
    fn quoted_scalars_are_refused_as_the_go_service_refuses_them() {
        let e = read_u32("10", true).unwrap_err();
        assert!(e.contains("quoted string \"10\""), "{e}");
        assert!(read_bool("true", true).is_err());
    }

    #[test]
    fn booleans_are_yaml_1_1_booleans() {
        for t in ["true", "True", "TRUE", "yes", "Yes", "on", "ON", "y", "Y"] {
            assert_eq!(read_bool(t, false), Ok(true), "{t}");
        }
        for f in [
            "false", "False", "no", "NO", "off", "n", "N", "", "~", "null",
        ] {
            assert_eq!(read_bool(f, false), Ok(false), "{f}");
        }
        for bad in ["tRue", "1", "0", "enabled"] {
            assert!(read_bool(bad, false).is_err(), "{bad}");
        }
    }
}
