//! `trajlog import-rllm-sqlite`: migrate an rLLM SQLite trace database into a
//! store, exactly.
//!
//! Two schemas exist. The gateway's: `traces(trace_id, data, created_at)` and
//! `trace_sessions(trace_id, session_id, run_id, created_at)`; each `data` is a
//! gateway trace dict, imported as the gateway adapter stores it. The older
//! SDK's: `traces(id, context_type, namespace, data, metadata, created_at,
//! updated_at)` and `trace_sessions(trace_id, session_uid[, created_at])`;
//! each row becomes an SDK call ([`super::sdk_to_call`]).
//!
//! The database is opened read-only. Traces are appended oldest first and
//! flushed at the end; with `verify`, every imported trace is then read back
//! from the store and compared with its row, field by field. Importing twice
//! is harmless: a trace id appended again replaces the earlier call.

use super::{call_to_sdk, get_path, put_path, same_json, sdk_to_call, take_path, SdkTrace, UNSCOPED_SESSION};
use crate::error::{Error, Result};
use crate::record::Call;
use crate::store::Store;
use crate::trace_json::{export_call, json_string, parse_gateway_exact};
use rusqlite::{Connection, OpenFlags};
use std::collections::HashMap;
use std::path::Path;

/// Which rLLM store wrote the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schema {
    /// rLLM gateway's `SqliteTraceStore` (trace dicts, one session per link).
    Gateway,
    /// The older rLLM SDK's `SqliteTraceStore` (namespaced records, nested session uids).
    Sdk,
}

impl Schema {
    pub fn name(self) -> &'static str {
        match self {
            Schema::Gateway => "gateway",
            Schema::Sdk => "sdk",
        }
    }
}

impl std::str::FromStr for Schema {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gateway" => Ok(Schema::Gateway),
            "sdk" => Ok(Schema::Sdk),
            other => Err(Error::invalid("schema", format!("{other:?} is not one of gateway, sdk"))),
        }
    }
}

/// What an import did.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportReport {
    pub schema: Schema,
    pub traces: u64,
    /// Rows of the session junction table carried over.
    pub session_links: u64,
    /// Token ids and logprobs written, in bytes (4 each).
    pub token_bytes: u64,
    /// Traces read back and found equal to their row (0 without verify).
    pub verified: u64,
}

fn db_err(db: &Path, e: rusqlite::Error) -> Error {
    Error::invalid("db", format!("reading rLLM database {}: {e}", db.display()))
}

fn columns(conn: &Connection, table: &str) -> rusqlite::Result<Vec<String>> {
    let mut stmt = conn.prepare(&format!("PRAGMA table_info({table})"))?;
    let names = stmt.query_map([], |row| row.get::<_, String>(1))?.collect();
    names
}

/// Tell the schema from the `traces` table's columns.
pub fn detect_schema(conn: &Connection, db: &Path) -> Result<Schema> {
    let cols = columns(conn, "traces").map_err(|e| db_err(db, e))?;
    let has = |c: &str| cols.iter().any(|x| x == c);
    if has("trace_id") && has("data") {
        Ok(Schema::Gateway)
    } else if has("id") && has("context_type") && has("data") {
        Ok(Schema::Sdk)
    } else if cols.is_empty() {
        Err(Error::invalid("db", format!("{} has no `traces` table; is it an rLLM trace database?", db.display())))
    } else {
        Err(Error::invalid(
            "db",
            format!("{}: `traces` has columns {cols:?}, neither rLLM's gateway nor its SDK schema", db.display()),
        ))
    }
}

/// Open an rLLM database read-only.
pub fn open_db(db: &Path) -> Result<Connection> {
    if !db.is_file() {
        return Err(Error::invalid("db", format!("{} is not a file", db.display())));
    }
    Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| db_err(db, e))
}

/// Session links by trace id, in the order they were written.
fn junction(conn: &Connection, db: &Path, session_col: &str) -> Result<HashMap<String, Vec<String>>> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    let sql = format!("SELECT trace_id, {session_col} FROM trace_sessions ORDER BY rowid");
    let mut stmt = conn.prepare(&sql).map_err(|e| db_err(db, e))?;
    let rows =
        stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))).map_err(|e| db_err(db, e))?;
    for row in rows {
        let (trace, session) = row.map_err(|e| db_err(db, e))?;
        out.entry(trace).or_default().push(session);
    }
    Ok(out)
}

/// The call a gateway row becomes. `trace_id`/`session_id` missing from the
/// dict are added from the row (as the gateway adapter does); the first linked
/// session is the call's `session_id` unless the dict names one, the others
/// become `session_uids`.
///
/// Returns the call and the trace dict (JSON text) it must read back as.
pub fn gateway_call(trace_id: &str, data: &str, created_at: f64, sessions: &[String]) -> Result<(Call, String)> {
    let mut text = data.to_owned();
    if get_path(&text, &["trace_id"]).is_none() {
        text = put_path(&text, &["trace_id"], &json_string(trace_id))
            .ok_or_else(|| Error::invalid(format!("traces[{trace_id}].data"), "must be a JSON object"))?;
    }
    if get_path(&text, &["session_id"]).is_none() {
        let session = sessions.first().map_or(UNSCOPED_SESSION, String::as_str);
        text = put_path(&text, &["session_id"], &json_string(session))
            .ok_or_else(|| Error::invalid(format!("traces[{trace_id}].data"), "must be a JSON object"))?;
    }
    let mut call = parse_gateway_exact(&text, created_at).map_err(|e| in_trace(trace_id, e))?;
    let linked_before = call.session_uids.len();
    for s in sessions {
        if *s != call.session_id && !call.session_uids.contains(s) {
            call.session_uids.push(s.clone());
        }
    }
    if call.session_uids.len() != linked_before {
        let uids: Vec<String> = call.session_uids.iter().map(|u| json_string(u)).collect();
        let list = format!("[{}]", uids.join(","));
        let rest = take_path(&text, &["session_uids"]).map_or(text, |(rest, _)| rest);
        text = put_path(&rest, &["session_uids"], &list).unwrap_or(rest);
    }
    call.validate().map_err(|e| in_trace(trace_id, e))?;
    Ok((call, text))
}

fn in_trace(trace_id: &str, e: Error) -> Error {
    let field = match e.kind() {
        crate::ErrorKind::InvalidInput { field } => format!("traces[{trace_id}].{field}"),
        _ => format!("traces[{trace_id}]"),
    };
    Error::invalid(field, e.message())
}

fn parse_value(what: &str, text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| Error::invalid(what, format!("not valid JSON ({e})")))
}

fn mismatch(trace_id: &str, what: &str) -> Error {
    Error::new(
        crate::ErrorKind::Corrupt { path: std::path::PathBuf::from("import"), offset: 0 },
        format!("import verification failed: trace {trace_id:?} read back with a different {what}"),
    )
}

/// Import `db` into `store`. `progress(done, total)` is called as rows go in.
pub fn import(
    db: &Path,
    store: &Store,
    schema: Option<Schema>,
    verify: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ImportReport> {
    let conn = open_db(db)?;
    let schema = match schema {
        Some(s) => s,
        None => detect_schema(&conn, db)?,
    };
    let total: u64 = conn.query_row("SELECT count(*) FROM traces", [], |r| r.get(0)).map_err(|e| db_err(db, e))?;
    let links = junction(&conn, db, if schema == Schema::Gateway { "session_id" } else { "session_uid" })?;
    let mut report = ImportReport {
        schema,
        traces: 0,
        session_links: links.values().map(|v| v.len() as u64).sum(),
        token_bytes: 0,
        verified: 0,
    };
    let none: Vec<String> = Vec::new();
    // (trace id, what to compare against) for verification.
    let mut expected: Vec<(String, Expected)> = Vec::new();
    match schema {
        Schema::Gateway => {
            let mut stmt = conn
                .prepare("SELECT trace_id, data, created_at FROM traces ORDER BY created_at, rowid")
                .map_err(|e| db_err(db, e))?;
            let mut rows = stmt.query([]).map_err(|e| db_err(db, e))?;
            while let Some(row) = rows.next().map_err(|e| db_err(db, e))? {
                let trace_id: String = row.get(0).map_err(|e| db_err(db, e))?;
                let data: String = row.get(1).map_err(|e| db_err(db, e))?;
                let created_at: f64 = row.get(2).map_err(|e| db_err(db, e))?;
                let (call, want) = gateway_call(&trace_id, &data, created_at, links.get(&trace_id).unwrap_or(&none))?;
                report.token_bytes += token_bytes(&call);
                if verify {
                    expected.push((trace_id.clone(), Expected::Gateway(want)));
                }
                store.append(call)?;
                report.traces += 1;
                progress(report.traces, total);
            }
        }
        Schema::Sdk => {
            let mut stmt = conn
                .prepare(
                    "SELECT id, context_type, namespace, data, metadata, created_at, updated_at FROM traces \
                     ORDER BY created_at, rowid",
                )
                .map_err(|e| db_err(db, e))?;
            let mut rows = stmt.query([]).map_err(|e| db_err(db, e))?;
            while let Some(row) = rows.next().map_err(|e| db_err(db, e))? {
                let get_s = |i: usize| row.get::<_, String>(i).map_err(|e| db_err(db, e));
                let t = SdkTrace {
                    trace_id: get_s(0)?,
                    context_type: get_s(1)?,
                    namespace: get_s(2)?,
                    data: get_s(3)?,
                    metadata: row
                        .get::<_, Option<String>>(4)
                        .map_err(|e| db_err(db, e))?
                        .unwrap_or_else(|| "null".to_owned()),
                    created_at: row.get(5).map_err(|e| db_err(db, e))?,
                    updated_at: row.get(6).map_err(|e| db_err(db, e))?,
                    session_uids: Vec::new(),
                };
                let t = SdkTrace { session_uids: links.get(&t.trace_id).cloned().unwrap_or_default(), ..t };
                let call = sdk_to_call(&t).map_err(|e| in_trace(&t.trace_id, e))?;
                report.token_bytes += token_bytes(&call);
                store.append(call)?;
                report.traces += 1;
                progress(report.traces, total);
                if verify {
                    expected.push((t.trace_id.clone(), Expected::Sdk(Box::new(t))));
                }
            }
        }
    }
    store.flush()?;
    if verify {
        let snap = store.snapshot();
        for (trace_id, want) in &expected {
            let call = snap.get(trace_id)?.ok_or_else(|| mismatch(trace_id, "presence (missing)"))?.to_call()?;
            want.check(trace_id, &call)?;
            report.verified += 1;
        }
    }
    Ok(report)
}

fn token_bytes(call: &Call) -> u64 {
    4 * (call.prompt_token_ids.len() + call.completion_token_ids.len() + call.logprobs.as_ref().map_or(0, Vec::len))
        as u64
}

enum Expected {
    /// The trace dict as Python must see it.
    Gateway(String),
    Sdk(Box<SdkTrace>),
}

impl Expected {
    fn check(&self, trace_id: &str, call: &Call) -> Result<()> {
        match self {
            Expected::Gateway(want) => {
                // As Python's `Call.to_dict()` shows it (export_call writes
                // logprobs as Python holds them).
                let got = parse_value("stored trace", &export_call(call))?;
                if !same_json(&got, &parse_value("trace", want)?) {
                    return Err(mismatch(trace_id, "trace dict"));
                }
            }
            Expected::Sdk(want) => {
                let got = call_to_sdk(call)?.ok_or_else(|| mismatch(trace_id, "kind (not an SDK record)"))?;
                if !same_json(&parse_value("data", &got.data)?, &parse_value("data", &want.data)?) {
                    return Err(mismatch(trace_id, "data"));
                }
                if !same_json(&parse_value("metadata", &got.metadata)?, &parse_value("metadata", &want.metadata)?) {
                    return Err(mismatch(trace_id, "metadata"));
                }
                let same = got.namespace == want.namespace
                    && got.context_type == want.context_type
                    && got.created_at.to_bits() == want.created_at.to_bits()
                    && got.updated_at.to_bits() == want.updated_at.to_bits()
                    && got.session_uids == want.session_uids;
                if !same {
                    return Err(mismatch(trace_id, "namespace, context_type, timestamps or session uids"));
                }
            }
        }
        Ok(())
    }
}
