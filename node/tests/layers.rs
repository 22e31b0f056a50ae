//! `lineage_node` has three layers, and imports only go down:
//!
//! - **wire**: the HTTP API (`api`), cluster management and Raft routes, the console;
//! - **service**: the write path (`app`, `batcher`), background work (`scrub`,
//!   `heads_rounds`, `disk_stall`), the metrics registry;
//! - **storage**: `store`, `raft_types`, `keys`, outgoing Raft (`network::raft_client`,
//!   `network::peer_contacts`);
//! - and leaves that import nothing of the crate (`store::agent_slot`, `log_noise`,
//!   `log_pace`,
//!   `spare_cores`, admission control for disk space, `disk_reserve`, which the state
//!   machine asks too, `election_hold`, and `disk_watch`, which the stores tell of their
//!   writes in flight).
//!
//! `lib.rs` wires them and is exempt; edges inside one layer are allowed. Nothing below the
//! wire layer names `axum`. The check reads every `use` tree (groups, renames, globs) and
//! every inline `crate::`/`super::`/`self::` path with `syn`, and tests itself on a
//! deliberate upward edge.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use syn::visit::Visit;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Layer {
    Leaf,
    Storage,
    Service,
    Wire,
}

/// Module prefixes and their layers; the longest matching prefix wins.
const LAYERS: &[(&str, Layer)] = &[
    ("api", Layer::Wire),
    ("network::management", Layer::Wire),
    ("network::raft_routes", Layer::Wire),
    ("console", Layer::Wire),
    ("app", Layer::Service),
    ("batcher", Layer::Service),
    ("scrub", Layer::Service),
    ("heads_rounds", Layer::Service),
    ("answer_expiry", Layer::Service),
    ("metrics", Layer::Service),
    ("idempotency_key", Layer::Service),
    ("request_rate", Layer::Service),
    ("read_rounds", Layer::Service),
    ("agent_lanes", Layer::Service),
    ("tls_reload", Layer::Service),
    ("reference_logs", Layer::Service),
    ("operator_changes", Layer::Service),
    ("import_writes", Layer::Service),
    ("store", Layer::Storage),
    ("raft_types", Layer::Storage),
    ("keys", Layer::Storage),
    ("rotating_secrets", Layer::Storage),
    ("dev_certs", Layer::Storage),
    ("network", Layer::Storage),
    ("network::raft_client", Layer::Storage),
    ("network::peer_contacts", Layer::Storage),
    ("store::agent_slot", Layer::Leaf),
    ("log_noise", Layer::Leaf),
    ("log_pace", Layer::Leaf),
    ("snapshot_spool", Layer::Leaf),
    ("disk_reserve", Layer::Leaf),
    ("election_hold", Layer::Leaf),
    ("disk_watch", Layer::Leaf),
    ("disk_stall", Layer::Service),
    ("tls", Layer::Leaf),
    ("spare_cores", Layer::Leaf),
];

fn layer_of(module: &str) -> Option<Layer> {
    LAYERS
        .iter()
        .filter(|(prefix, _)| module == *prefix || module.starts_with(&format!("{prefix}::")))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(_, layer)| *layer)
}

/// A module's source: its path in the crate (`""` for the root) and its text.
struct Source {
    module: String,
    text: String,
}

/// Every path a module names: use-trees flattened, and inline paths.
#[derive(Default)]
struct Paths {
    /// (the module the path appears in, including inline modules; the path's segments)
    found: Vec<(String, Vec<String>)>,
    scope: Vec<String>,
}

impl Paths {
    fn add(&mut self, segments: Vec<String>) {
        self.found.push((self.scope.join("::"), segments));
    }

    fn flatten(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.flatten(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let mut path = prefix.clone();
                path.push(n.ident.to_string());
                self.add(path);
            }
            syn::UseTree::Rename(r) => {
                let mut path = prefix.clone();
                path.push(r.ident.to_string());
                self.add(path);
            }
            syn::UseTree::Glob(_) => self.add(prefix.clone()),
            syn::UseTree::Group(g) => {
                for item in &g.items {
                    self.flatten(prefix, item);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.flatten(&mut Vec::new(), &item.tree);
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.scope.push(item.ident.to_string());
        syn::visit::visit_item_mod(self, item);
        self.scope.pop();
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if segments.len() > 1 {
            self.add(segments);
        }
        syn::visit::visit_path(self, path);
    }
}

/// The module a path names, as a crate path (`None`: outside the crate, or the root).
fn resolve(modules: &BTreeSet<String>, from: &str, segments: &[String]) -> Option<String> {
    let mut base: Vec<String> = if from.is_empty() {
        Vec::new()
    } else {
        from.split("::").map(str::to_string).collect()
    };
    let mut rest = segments;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        // A child module named without `self::` (2018 paths), else another crate.
        Some(first) => {
            let child = [base.clone(), vec![first.to_string()]].concat().join("::");
            if !modules.contains(&child) {
                return None;
            }
        }
        None => return None,
    }
    let mut path = base;
    let mut named = None;
    for segment in rest {
        path.push(segment.clone());
        let candidate = path.join("::");
        if modules.contains(&candidate) {
            named = Some(candidate);
        } else {
            break;
        }
    }
    named
}

/// Every edge that goes up a layer (or names axum below the wire layer).
fn violations(sources: &[Source]) -> Vec<String> {
    let mut modules: BTreeSet<String> = sources.iter().map(|s| s.module.clone()).collect();
    let mut found = Vec::new();
    for source in sources {
        let file = syn::parse_file(&source.text)
            .unwrap_or_else(|e| panic!("module {:?} does not parse: {e}", source.module));
        let mut paths = Paths::default();
        if !source.module.is_empty() {
            paths.scope = source.module.split("::").map(str::to_string).collect();
        }
        paths.visit_file(&file);
        for (scope, _) in &paths.found {
            modules.insert(scope.clone());
        }
        found.push((source.module.clone(), paths.found));
    }
    let mut bad = Vec::new();
    for (module, paths) in found {
        let Some(from) = layer_of(&module) else {
            continue; // the root (lib.rs) wires everything
        };
        for (scope, segments) in paths {
            if segments.first().map(String::as_str) == Some("axum") && from != Layer::Wire {
                bad.push(format!(
                    "{module} ({from:?}) names axum: {}",
                    segments.join("::")
                ));
            }
            let Some(target) = resolve(&modules, &scope, &segments) else {
                continue;
            };
            if target == module || target.starts_with(&format!("{module}::")) {
                continue;
            }
            match layer_of(&target) {
                Some(to) if to > from => bad.push(format!(
                    "{module} ({from:?}) imports {target} ({to:?}): {}",
                    segments.join("::")
                )),
                None => bad.push(format!(
                    "{module} ({from:?}) imports a module with no layer: {}",
                    segments.join("::")
                )),
                _ => {}
            }
        }
    }
    bad
}

/// The library's modules: every `.rs` file under `src/` except the binary's own.
fn library_sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let binary_only = [
        "main.rs",
        "dev_cluster.rs",
        "dev_supervisor.rs",
        "node_import.rs",
    ];
    let mut files = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path: PathBuf = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files
        .into_iter()
        .filter(|path| {
            path.parent() != Some(root.as_path())
                || !binary_only.contains(&path.file_name().and_then(|n| n.to_str()).unwrap_or(""))
        })
        .map(|path| {
            let relative = path.strip_prefix(&root).expect("under src");
            let mut parts: Vec<String> = relative
                .iter()
                .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
                .collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            Source {
                module: parts.join("::"),
                text: std::fs::read_to_string(&path).expect("read source"),
            }
        })
        .collect()
}

#[test]
fn imports_only_go_down() {
    let sources = library_sources();
    assert!(sources.len() > 30, "found only {} modules", sources.len());
    for source in &sources {
        assert!(
            source.module.is_empty() || layer_of(&source.module).is_some(),
            "module {} has no layer: add it to LAYERS",
            source.module
        );
    }
    let bad = violations(&sources);
    assert!(bad.is_empty(), "imports that go up:\n{}", bad.join("\n"));
}

#[test]
fn the_check_finds_an_upward_edge_in_every_form() {
    let source = |module: &str, text: &str| Source {
        module: module.to_string(),
        text: text.to_string(),
    };
    let sources = [
        source("api", "pub mod error;"),
        source("api::error", "pub struct ApiError;"),
        source("store", "pub mod agent_slot;"),
        source("store::agent_slot", "pub enum AgentSlot {}"),
        // Grouped imports, an inline path, a relative path, a glob in an inline module,
        // and axum below the wire layer.
        source(
            "app",
            "use crate::{store::AgentSlot, api::{error::ApiError}};\n\
             fn f() -> crate::api::error::ApiError { todo!() }\n\
             mod inner { use super::super::api::*; }\n\
             use axum::http::StatusCode;",
        ),
        source("store::heads", "use super::agent_slot::AgentSlot;"),
        source("api::agents", "use crate::app; use super::error::ApiError;"),
    ];
    let bad = violations(&sources);
    let upward = |needle: &str| bad.iter().filter(|b| b.contains(needle)).count();
    assert_eq!(
        upward("app (Service) imports api::error (Wire)"),
        2,
        "{bad:#?}"
    );
    assert_eq!(upward("app (Service) imports api (Wire)"), 1, "{bad:#?}");
    assert_eq!(upward("names axum"), 1, "{bad:#?}");
    assert_eq!(bad.len(), 4, "downward and sideways edges pass: {bad:#?}");
}
