//! Property: any JSON a request can carry becomes a record whose line reads back as the
//! same record, with the same hash. A follower, a restarted node and an auditor all
//! parse the line; if the parse gave back other content (a float off by one bit, an
//! integer past u64), their hash would not match the signed one.

use lineage_core::canonical::{self, MAX_VALUE_DEPTH};
use lineage_core::record::{Record, ZERO_HASH};
use lineage_core::AuditKey;
use proptest::prelude::*;
use serde_json::Value;

/// JSON number tokens as a client may write them.
fn number_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        Just(u64::MAX.to_string()),
        Just(i64::MIN.to_string()),
        // Integers past u64::MAX (and below i64::MIN) parse as floats.
        (0u64..1000, "[0-9]{1,30}").prop_map(|(n, tail)| format!("{}{n}{tail}", u64::MAX)),
        (0u64..1000).prop_map(|n| format!("-{}{n}", i64::MAX)),
        // Every finite f64, with 17 significant digits and in Rust's shortest forms.
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| format!("{f:.16e}")),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| format!("{f:?}")),
        // Subnormals and the edges of the exponent range.
        (1u64..(1 << 52)).prop_map(|bits| format!("{:e}", f64::from_bits(bits))),
        Just("5e-324".into()),
        Just("1.7976931348623157e+308".into()),
        Just("-0".into()),
        Just("-0.0".into()),
        Just("1E21".into()),
        Just("0.30000000000000004".into()),
        Just("3.4980118210031664e-13".into()),
    ]
}

/// JSON string tokens with every kind of escape a client may send.
fn string_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[ -~]{0,6}".prop_map(|s| s.replace('\\', "\\\\").replace('"', "\\\"")),
        any::<char>().prop_map(|c| match c {
            '"' => "\\\"".to_string(),
            '\\' => "\\\\".to_string(),
            c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32),
            c => c.to_string(),
        }),
        any::<char>().prop_map(|c| {
            let mut units = [0u16; 2];
            c.encode_utf16(&mut units)
                .iter()
                .map(|u| format!("\\u{u:04X}"))
                .collect::<String>()
        }),
        prop::sample::select(vec![
            "\\n", "\\t", "\\b", "\\f", "\\r", "\\/", "\u{2028}", "\u{7f}"
        ])
        .prop_map(String::from),
    ];
    prop::collection::vec(piece, 0..6).prop_map(|pieces| format!("\"{}\"", pieces.concat()))
}

/// A JSON text: scalars, arrays and objects (duplicate keys included) nested a few levels.
fn json_text() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        3 => number_text(),
        2 => string_text(),
        1 => prop::sample::select(vec!["null", "true", "false"]).prop_map(String::from),
    ];
    leaf.prop_recursive(6, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6)
                .prop_map(|items| format!("[{}]", items.join(","))),
            prop::collection::vec((string_text(), inner), 0..6).prop_map(|fields| {
                let fields: Vec<String> = fields
                    .into_iter()
                    .map(|(k, v)| format!("{k}:{v}"))
                    .collect();
                format!("{{{}}}", fields.join(","))
            }),
        ]
    })
}

fn sealed_with_input(input: Value) -> Record {
    let key = AuditKey::from_seed([9; 32]);
    let payload = serde_json::json!({"action_id": "act-1", "cost": 1, "input": input, "tool": "s"});
    Record::seal(
        &key,
        2,
        "2026-12-01T12:00:00.000000Z".into(),
        "bot",
        "action_requested",
        payload,
        ZERO_HASH,
    )
}

fn assert_round_trips(input: Value) {
    let record = sealed_with_input(input);
    let (line, parsed) = record.to_checked_line().expect("the line reads back");
    let reread = Record::from_line(&line).unwrap();
    assert_eq!(hex::encode(reread.recompute_hash()), record.hash);
    assert_eq!(reread.to_line(), line);
    assert_eq!(parsed.to_line(), line);
    assert_eq!(
        canonical::to_string(&reread.payload),
        canonical::to_string(&record.payload)
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn any_request_json_round_trips_through_its_line(text in json_text()) {
        let input: Value = serde_json::from_str(&text).expect("the generator writes JSON");
        assert_round_trips(input);
    }

    #[test]
    fn any_finite_float_round_trips(f in any::<f64>().prop_filter("finite", |f| f.is_finite())) {
        assert_round_trips(serde_json::json!({"score": f, "text": format!("{f:.16e}")}));
        let parsed: Value = serde_json::from_str(&format!("{f:.16e}")).unwrap();
        assert_round_trips(parsed);
    }
}

#[test]
fn nesting_up_to_the_limit_round_trips() {
    // The payload adds a level above the input: the input may be MAX_VALUE_DEPTH - 1 deep.
    let depth = MAX_VALUE_DEPTH - 1;
    let text = format!(
        "{}3.4980118210031664e-13{}",
        "[{\"k\":".repeat(depth / 2),
        "}]".repeat(depth / 2)
    );
    let input: Value = serde_json::from_str(&text).unwrap();
    assert!(canonical::depth(&input) >= depth - 1);
    assert_round_trips(input);
}
