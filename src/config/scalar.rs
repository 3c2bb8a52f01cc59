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
    let (negative, body) = match plain.as_bytes().first() {
        Some(b'-') => (true, &plain[1..]),
        Some(b'+') => (false, &plain[1..]),
        _ => (false, plain),
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
    if !digits.is_empty() && digits.chars().all(|c| c.is_digit(radix)) {
        // Longer than any field holds: saturate, it is refused either way.
        let v = i128::from_str_radix(digits, radix).unwrap_or(i128::MAX);
        return Some(GoNumber::Int(if negative { -v } else { v }));
    }
    yaml_float(plain).map(|_| GoNumber::Float)
}

/// YAML 1.1's float syntax as yaml.v2 checks it
/// (`[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?`), parsed.
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
    s.parse().ok()
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
