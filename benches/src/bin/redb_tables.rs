//! Where a redb file's pages go, table by table: for a look inside a data directory a
//! bench kept (`LINEAGE_BENCH_KEEP_DATA=1`), with the node stopped (redb locks its file).
//!
//!   target/release/redb_tables DATA_DIR/node.redb [--records N]
//!
//! Per table: its rows, the bytes of keys and values stored, its leaf and branch pages,
//! and how full its leaves are; then the file's length and the pages redb has allocated.
//! With `--records`, the bytes are also given per record.

use redb::{ReadableTableMetadata, TableHandle};

/// Where a redb file's pages go, table by table.
#[derive(clap::Parser)]
struct Args {
    /// The redb file (its node stopped).
    file: String,
    /// Records in it, for bytes per record.
    #[arg(long, default_value_t = 0)]
    records: u64,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    lineage_benches::exit_on_error("redb_tables", run(&args.file, args.records));
}

fn run(path: &str, records: u64) -> Result<(), String> {
    let per_record = |bytes: u64| {
        if records == 0 {
            String::new()
        } else {
            format!("{:>9.1}", bytes as f64 / records as f64)
        }
    };
    let db = redb::Database::open(path).map_err(|e| format!("{path}: {e}"))?;
    let txn = db.begin_read().map_err(|e| e.to_string())?;
    let page = 4096u64;
    println!(
        "{:<20} {:>10} {:>12} {:>8} {:>8} {:>7} {:>12}{}",
        "table",
        "rows",
        "stored B",
        "leaves",
        "branches",
        "fill",
        "pages B",
        if records == 0 { "" } else { "  pages B/rec" }
    );
    let mut total_pages = 0;
    for handle in txn.list_tables().map_err(|e| e.to_string())? {
        let table = txn
            .open_untyped_table(handle.clone())
            .map_err(|e| format!("{}: {e}", handle.name()))?;
        let stats = table.stats().map_err(|e| e.to_string())?;
        let rows = table.len().map_err(|e| e.to_string())?;
        let pages = stats.leaf_pages() + stats.branch_pages();
        total_pages += pages;
        println!(
            "{:<20} {:>10} {:>12} {:>8} {:>8} {:>6.0}% {:>12}{}",
            handle.name(),
            rows,
            stats.stored_bytes(),
            stats.leaf_pages(),
            stats.branch_pages(),
            100.0 * stats.stored_bytes() as f64 / (stats.leaf_pages().max(1) * page) as f64,
            pages * page,
            per_record(pages * page)
        );
    }
    // redb counts allocated pages only in a write transaction; this one is aborted.
    let writer = db.begin_write().map_err(|e| e.to_string())?;
    let all = writer.stats().map_err(|e| e.to_string())?;
    writer.abort().map_err(|e| e.to_string())?;
    let length = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
    println!(
        "{:<20} {:>10} {:>12} {:>8} {:>8} {:>7} {:>12}{}",
        "tables",
        "",
        "",
        "",
        "",
        "",
        total_pages * page,
        per_record(total_pages * page)
    );
    println!(
        "{:<20} {:>10} {:>12} {:>8} {:>8} {:>7} {:>12}{}",
        "allocated",
        "",
        "",
        "",
        "",
        "",
        all.allocated_pages() * all.page_size() as u64,
        per_record(all.allocated_pages() * all.page_size() as u64)
    );
    println!(
        "{:<20} {:>10} {:>12} {:>8} {:>8} {:>7} {:>12}{}",
        "file length",
        "",
        "",
        "",
        "",
        "",
        length,
        per_record(length)
    );
    Ok(())
}
