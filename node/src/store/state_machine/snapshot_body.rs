//! A snapshot's body: the whole state machine as one JSON object, written row by row from
//! a read transaction and installed as it is parsed, so neither side ever holds the whole
//! state in memory (the body itself waits in a spool file: `snapshot.rs`).
//!
//! The object: `records` (agent id to its lines from seq 0, agents in ascending order),
//! `idempotency` (`[key, answer]` pairs), `heads` (the heads log), and, only when there
//! are any, `system`, `imports`, `tombstones` and `import_points`. The bytes are pinned by
//! `tests/format_pin.rs`: a node must install what an older one sends.

use std::fmt;
use std::io::{Read, Write};

use redb::{ReadableTable, Table};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserializer, Serialize};

use super::super::heads::{HeadsLog, HeadsSnapshot};
use super::super::idempotency_rows::IDEMPOTENCY;
use super::super::imports::{self, ImportPoint};
use super::super::record_ends;
use super::super::record_rows::{self, RunWriter};
use super::super::{idempotency_rows, system_log};
use super::{AGENT_CHECKPOINTS, AGENT_INDEX, RECORDS};
use crate::raft_types::{IdempotentAnswer, ImportManifest, Tombstone};

/// One value as JSON onto `out`.
fn json(out: &mut impl Write, value: &impl Serialize) -> Result<(), String> {
    serde_json::to_writer(out, value).map_err(|e| e.to_string())
}

/// Writes the snapshot body, the JSON of [`SnapshotBody`] byte for byte, straight from a
/// read transaction: rows go out as they are read, so memory never holds the whole state
/// (only the heads log's leaves, which grow with rounds, not records).
pub(super) fn write_body(txn: &redb::ReadTransaction, out: &mut impl Write) -> Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    let records = txn.open_table(RECORDS).map_err(|e| e.to_string())?;
    let packed = txn
        .open_table(record_rows::PACKED_RUNS)
        .map_err(|e| e.to_string())?;
    out.write_all(b"{\"records\":{").map_err(io)?;
    let mut current: Option<(String, u64)> = None;
    // Where each agent's lines sent end, held to the stored ends (`record_ends`).
    let mut sent = std::collections::BTreeMap::new();
    record_rows::visit_all(&records, &packed, |agent, seq, line| {
        match &mut current {
            Some((name, next)) if name == agent => {
                // Snapshots carry each agent's records from seq 0 without a gap.
                if seq != *next {
                    return Err(format!("{agent}: stored records jump to seq {seq}"));
                }
                out.write_all(b",").map_err(io)?;
                *next += 1;
            }
            _ => {
                if seq != 0 {
                    return Err(format!("{agent}: stored records start at seq {seq}"));
                }
                if let Some((done, next)) = current.take() {
                    sent.insert(done, next);
                    out.write_all(b"],").map_err(io)?;
                }
                json(out, &agent)?;
                out.write_all(b":[").map_err(io)?;
                current = Some((agent.to_string(), 1));
            }
        }
        json(out, &line)
    })?;
    if let Some((done, next)) = current {
        sent.insert(done, next);
        out.write_all(b"]").map_err(io)?;
    }
    let ends = txn
        .open_table(record_ends::RECORD_ENDS)
        .map_err(|e| e.to_string())?;
    record_ends::check_sent(&ends, &sent)?;
    out.write_all(b"},\"idempotency\":[").map_err(io)?;
    let idem = txn.open_table(IDEMPOTENCY).map_err(|e| e.to_string())?;
    for (n, item) in idem.iter().map_err(|e| e.to_string())?.enumerate() {
        let (key, value) = item.map_err(|e| e.to_string())?;
        let scoped = key
            .value()
            .split_once('\n')
            .map_or("", |(_agent, scoped)| scoped);
        // One damaged row must not stop every snapshot (and with it the node): it
        // travels as an answer that refuses, as it is refused here.
        let answer = idempotency_rows::decode(value.value(), scoped).unwrap_or_else(|e| {
            tracing::error!(key = %key.value(), error = %e, "stored idempotent answer damaged");
            idempotency_rows::damaged(scoped, &e)
        });
        out.write_all(if n == 0 { b"[" } else { b",[" })
            .map_err(io)?;
        json(out, &key.value())?;
        out.write_all(b",").map_err(io)?;
        json(out, &answer)?;
        out.write_all(b"]").map_err(io)?;
    }
    out.write_all(b"],\"heads\":").map_err(io)?;
    let heads = HeadsLog::snapshot(txn).map_err(|e| e.to_string())?;
    json(out, &heads)?;
    // Written only when there is one, so a cluster without operators keeps the body
    // older versions wrote (and read).
    let system = system_log::lines(txn, 0, usize::MAX)?;
    if !system.is_empty() {
        out.write_all(b",\"system\":").map_err(io)?;
        json(out, &system)?;
    }
    let imports = imports::markers(txn)?;
    if !imports.is_empty() {
        out.write_all(b",\"imports\":").map_err(io)?;
        json(out, &imports)?;
    }
    let tombstones = imports::tombstones(txn)?;
    if !tombstones.is_empty() {
        out.write_all(b",\"tombstones\":").map_err(io)?;
        json(out, &tombstones)?;
    }
    let points = imports::import_points(txn)?;
    if !points.is_empty() {
        out.write_all(b",\"import_points\":").map_err(io)?;
        json(out, &points)?;
    }
    out.write_all(b"}").map_err(io)?;
    Ok(())
}

/// The tables a body's records and answers go into as they are parsed.
struct Tables<'txn> {
    records: Table<'txn, (&'static str, u64), &'static str>,
    /// Where each agent's records end (`record_ends`), written as its lines are read.
    ends: Table<'txn, &'static str, &'static [u8]>,
    index: Table<'txn, &'static str, ()>,
    idempotency: Table<'txn, &'static str, &'static [u8]>,
}

/// What a body holds beside its records and answers: small (it grows with checkpoint
/// rounds and operators, not with records), so it is parsed whole.
#[derive(Default)]
struct Rest {
    heads: HeadsSnapshot,
    system: Vec<String>,
    imports: Vec<(String, ImportManifest)>,
    tombstones: Vec<(String, Tombstone)>,
    import_points: Vec<(String, ImportPoint)>,
}

/// Replaces the state machine's tables with the body read from `reader`. Records and
/// idempotent answers are written as they are parsed (records in runs, `record_rows`),
/// so memory holds one run, not the body. Nothing is committed here: on an error the
/// caller drops `txn` and the tables stay as they were.
pub(super) fn install_body(txn: &redb::WriteTransaction, reader: impl Read) -> Result<(), String> {
    let store = |e: redb::Error| e.to_string();
    let mut checkpoints = txn
        .open_table(AGENT_CHECKPOINTS)
        .map_err(|e| e.to_string())?;
    checkpoints
        .retain(|_, _| false)
        .map_err(|e| e.to_string())?;
    drop(checkpoints);
    // The body's records are written raw (`RunWriter`); packed at the agents' next merges.
    txn.open_table(record_rows::PACKED_RUNS)
        .map_err(|e| e.to_string())?
        .retain(|_, _| false)
        .map_err(|e| e.to_string())?;
    let mut tables = Tables {
        records: txn.open_table(RECORDS).map_err(|e| e.to_string())?,
        ends: txn
            .open_table(record_ends::RECORD_ENDS)
            .map_err(|e| e.to_string())?,
        index: txn.open_table(AGENT_INDEX).map_err(|e| e.to_string())?,
        idempotency: txn.open_table(IDEMPOTENCY).map_err(|e| e.to_string())?,
    };
    tables
        .records
        .retain(|_, _| false)
        .map_err(|e| e.to_string())?;
    tables
        .ends
        .retain(|_, _| false)
        .map_err(|e| e.to_string())?;
    tables
        .index
        .retain(|_, _| false)
        .map_err(|e| e.to_string())?;
    tables
        .idempotency
        .retain(|_, _| false)
        .map_err(|e| e.to_string())?;
    let mut parser = serde_json::Deserializer::from_reader(reader);
    let rest = BodySeed {
        tables: &mut tables,
    }
    .deserialize(&mut parser)
    .map_err(|e| format!("snapshot body: {e}"))?;
    parser
        .end()
        .map_err(|e| format!("snapshot body: after its end: {e}"))?;
    drop(tables);
    HeadsLog::install(txn, &rest.heads).map_err(store)?;
    system_log::install(txn, &rest.system).map_err(store)?;
    imports::install(txn, &rest.imports, &rest.tombstones, &rest.import_points)
}

fn custom<E: de::Error>(error: impl fmt::Display) -> E {
    E::custom(error)
}

/// The body's object: each field to its table as it comes, or into [`Rest`].
struct BodySeed<'a, 'txn> {
    tables: &'a mut Tables<'txn>,
}

impl<'de> DeserializeSeed<'de> for BodySeed<'_, '_> {
    type Value = Rest;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Rest, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_, '_> {
    type Value = Rest;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a snapshot body (a JSON object)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Rest, A::Error> {
        let tables = self.tables;
        let mut rest = Rest::default();
        let mut seen: Vec<String> = Vec::new();
        while let Some(field) = map.next_key::<String>()? {
            // A second `records` would be written over the first's rows.
            if seen.contains(&field) {
                return Err(custom(format!("field '{field}' appears twice")));
            }
            match field.as_str() {
                "records" => map.next_value_seed(RecordsSeed {
                    tables: &mut *tables,
                })?,
                "idempotency" => map.next_value_seed(AnswersSeed {
                    table: &mut tables.idempotency,
                })?,
                "heads" => rest.heads = map.next_value()?,
                "system" => rest.system = map.next_value()?,
                "imports" => rest.imports = map.next_value()?,
                "tombstones" => rest.tombstones = map.next_value()?,
                "import_points" => rest.import_points = map.next_value()?,
                // A field a newer version added: not this version's to install.
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            seen.push(field);
        }
        for required in ["records", "idempotency"] {
            if !seen.iter().any(|field| field == required) {
                return Err(de::Error::missing_field(required));
            }
        }
        Ok(rest)
    }
}

/// `records`: agent id to its lines, agents in ascending order (as they are stored).
struct RecordsSeed<'a, 'txn> {
    tables: &'a mut Tables<'txn>,
}

impl<'de> DeserializeSeed<'de> for RecordsSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for RecordsSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object of agents' records")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let tables = self.tables;
        let mut runs = RunWriter::default();
        let mut previous: Option<String> = None;
        while let Some(agent) = map.next_key::<String>()? {
            // Ascending order is what runs need, and it refuses an agent named twice.
            if let Some(before) = previous
                .as_deref()
                .filter(|before| *before >= agent.as_str())
            {
                return Err(custom(format!(
                    "agent '{agent}' comes after '{before}': agents must be in ascending order, each once"
                )));
            }
            tables.index.insert(agent.as_str(), ()).map_err(custom)?;
            map.next_value_seed(LinesSeed {
                agent: &agent,
                runs: &mut runs,
                records: &mut tables.records,
                ends: &mut tables.ends,
            })?;
            previous = Some(agent);
        }
        runs.finish(&mut tables.records).map_err(custom)
    }
}

/// One agent's lines, from seq 0.
struct LinesSeed<'a, 'txn> {
    agent: &'a str,
    runs: &'a mut RunWriter,
    records: &'a mut Table<'txn, (&'static str, u64), &'static str>,
    ends: &'a mut Table<'txn, &'static str, &'static [u8]>,
}

impl<'de> DeserializeSeed<'de> for LinesSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for LinesSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of record lines")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut lines: A) -> Result<(), A::Error> {
        let mut seq = 0u64;
        while let Some(line) = lines.next_element::<String>()? {
            // A line holding a newline would split its run's row in two records.
            if line.contains('\n') {
                return Err(custom(format!(
                    "{}: the line of seq {seq} holds a newline",
                    self.agent
                )));
            }
            self.runs
                .push(self.records, self.agent, seq, &line)
                .map_err(custom)?;
            seq += 1;
        }
        record_ends::put(self.ends, self.agent, seq).map_err(custom)?;
        Ok(())
    }
}

/// `idempotency`: `[key, answer]` pairs, each sealed into its row as it comes.
struct AnswersSeed<'a, 'txn> {
    table: &'a mut Table<'txn, &'static str, &'static [u8]>,
}

impl<'de> DeserializeSeed<'de> for AnswersSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for AnswersSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of [key, answer] pairs")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut pairs: A) -> Result<(), A::Error> {
        while let Some((key, answer)) = pairs.next_element::<(String, IdempotentAnswer)>()? {
            let row = idempotency_rows::encode(&answer).map_err(custom)?;
            self.table
                .insert(key.as_str(), row.as_slice())
                .map_err(custom)?;
        }
        Ok(())
    }
}
