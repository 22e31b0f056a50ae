//! Canonical JSON as `lineage-audit-v1` hashes it.
//!
//! Objects have their keys sorted by byte-wise UTF-8 order at every depth, there is no
//! whitespace, strings are escaped minimally (see [`write_str`]), integers are plain
//! decimal and floats use the shortest round-trip digits, positional for decimal
//! exponents in −5..=15 and `d.ddde±N` otherwise. The output is byte-for-byte what the
//! reference implementation hashes, independent of which `serde_json` version or
//! features the build happens to unify on.

use serde_json::{Number, Value};

/// The canonical text of `value`.
pub fn to_string(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

/// The deepest nesting a stored value may have. Records are read back with
/// `serde_json`'s limit of 128 levels, and a record adds two levels (itself and its
/// payload) above a tool's input, so anything deeper than this could be written but
/// never read again.
pub const MAX_VALUE_DEPTH: usize = 100;

/// Nesting depth: 0 for a scalar, 1 + the deepest child for arrays and objects.
pub fn depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Appends the canonical text of `value` to `out`.
///
/// Recursion depth equals the nesting depth of `value`; values parsed by `serde_json`
/// are limited to 128 levels, so this cannot overflow the stack on parsed input.
pub fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(number) => write_number(out, number),
        Value::String(text) => write_str(out, text),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            // Sort explicitly: with serde_json's `preserve_order` feature unified in by some
            // other crate, the map would iterate in insertion order.
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_str(out, key);
                out.push(':');
                write_value(out, item);
            }
            out.push('}');
        }
    }
}

/// Writes a JSON string literal: `"` and `\` escaped, `\b \t \n \f \r` in short form,
/// other control characters as `\u00xx` (lowercase), everything else raw UTF-8.
pub fn write_str(out: &mut String, text: &str) {
    out.reserve(text.len() + 2);
    out.push('"');
    let mut clean_from = 0;
    for (i, byte) in text.bytes().enumerate() {
        let escape: Option<&str> = match byte {
            b'"' => Some("\\\""),
            b'\\' => Some("\\\\"),
            0x08 => Some("\\b"),
            b'\t' => Some("\\t"),
            b'\n' => Some("\\n"),
            0x0c => Some("\\f"),
            b'\r' => Some("\\r"),
            0x00..=0x1f => Some(""),
            _ => None,
        };
        if let Some(short) = escape {
            out.push_str(&text[clean_from..i]);
            if short.is_empty() {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.push_str("\\u00");
                out.push(HEX[(byte >> 4) as usize] as char);
                out.push(HEX[(byte & 0xf) as usize] as char);
            } else {
                out.push_str(short);
            }
            clean_from = i + 1;
        }
    }
    out.push_str(&text[clean_from..]);
    out.push('"');
}

fn write_number(out: &mut String, number: &Number) {
    if let Some(n) = number.as_u64() {
        out.push_str(&n.to_string());
    } else if let Some(n) = number.as_i64() {
        out.push_str(&n.to_string());
    } else if let Some(f) = number.as_f64() {
        write_float(out, f);
    } else {
        // Unreachable without serde_json's `arbitrary_precision`; fall back to its text.
        out.push_str(&number.to_string());
    }
}

/// Shortest round-trip float formatting in the reference's layout.
pub fn write_float(out: &mut String, f: f64) {
    if !f.is_finite() {
        // JSON has no NaN or infinity; serde_json writes them as null.
        out.push_str("null");
        return;
    }
    // Rust's `{:e}` without precision yields the shortest digits that round-trip,
    // e.g. "1e16", "-2.5e-8", "1.7976931348623157e308", "0e0".
    let sci = format!("{f:e}");
    let (mantissa, exponent) = match sci.split_once('e') {
        Some(parts) => parts,
        None => (sci.as_str(), "0"),
    };
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    if negative {
        out.push('-');
    }
    if (-5..=15).contains(&exponent) {
        if exponent >= 0 {
            let int_len = exponent as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exponent - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exponent < 0 { '-' } else { '+' });
        out.push_str(&exponent.unsigned_abs().to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn float(f: f64) -> String {
        let mut s = String::new();
        write_float(&mut s, f);
        s
    }

    #[test]
    fn floats_match_the_reference_layout() {
        let cases = [
            (100.0, "100.0"),
            (1e15, "1000000000000000.0"),
            (0.00001, "0.00001"),
            (0.000015, "0.000015"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (1e16, "1e+16"),
            (1e-6, "1e-6"),
            (2.5e-8, "2.5e-8"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (1.5, "1.5"),
            (-123.456, "-123.456"),
            (1.8446744073709552e19, "1.8446744073709552e+19"),
        ];
        for (value, expected) in cases {
            assert_eq!(float(value), expected, "formatting {value:e}");
        }
    }

    #[test]
    fn parsed_numbers_keep_their_reference_form() {
        let parsed: Value =
            serde_json::from_str(r#"[18446744073709551616, -0, 1.0, -5, 18446744073709551615]"#)
                .unwrap();
        assert_eq!(
            to_string(&parsed),
            "[1.8446744073709552e+19,-0.0,1.0,-5,18446744073709551615]"
        );
    }

    #[test]
    fn keys_sort_bytewise_at_every_depth() {
        let value = json!({"b": {"z": 1, "a": [ {"y": true, "x": null} ]}, "a": "é", "B": 2, "é": 0, "\u{10000}": 1, "\u{ffff}": 2});
        assert_eq!(
            to_string(&value),
            r#"{"B":2,"a":"é","b":{"a":[{"x":null,"y":true}],"z":1},"é":0,"￿":2,"𐀀":1}"#
        );
    }

    #[test]
    fn strings_escape_only_what_json_requires() {
        let value = json!("q\" b\\ \u{8}\t\n\u{c}\r \u{1} \u{1f} \u{7f} / \u{2028} ü");
        assert_eq!(
            to_string(&value),
            "\"q\\\" b\\\\ \\b\\t\\n\\f\\r \\u0001 \\u001f \u{7f} / \u{2028} ü\""
        );
    }

    #[test]
    fn duplicate_keys_keep_the_last() {
        let value: Value = serde_json::from_str(r#"{"a":1,"a":2}"#).unwrap();
        assert_eq!(to_string(&value), r#"{"a":2}"#);
    }
}
