//! The layering of `crates/ferroccl/src`, checked: every `crate::` path in a module names a
//! module on a lower floor of the table in `docs/architecture.md` (the fenced `layers`
//! block, top floor first), so no import runs back up and the modules cannot form a
//! circle. A folder (`algo/`, `bootstrap/`, `transport/`) is one module; what its files
//! import from each other is its own business. Every module must be on the table, so that
//! a new one cannot slip past the check.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Floors of the layer table, top first: module names.
fn floors() -> Vec<Vec<String>> {
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/architecture.md");
    let text = std::fs::read_to_string(&doc).unwrap_or_else(|e| panic!("read {}: {e}", doc.display()));
    let start = text.find("```layers\n").expect("docs/architecture.md has no ```layers block") + "```layers\n".len();
    let end = start + text[start..].find("```").expect("the ```layers block is not closed");
    text[start..end]
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .filter(|f| !f.is_empty())
        .collect()
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())).flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module a source file belongs to: its first path component under `src/`, without
/// `.rs`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("file under src");
    let first = rel.components().next().expect("non-empty path").as_os_str().to_string_lossy().to_string();
    first.trim_end_matches(".rs").to_string()
}

/// The modules a file's code names through `crate::` (comments left out; `crate::{a, b}`
/// and `crate::a::{..}` both understood), with the line of the first mention.
fn imports(text: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let code = match code.find("//") {
            Some(i) if !code[..i].contains('"') => &code[..i],
            _ => code,
        };
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            let after = &rest[i + "crate::".len()..];
            let names: Vec<&str> = if let Some(group) = after.strip_prefix('{') {
                group.split('}').next().unwrap_or("").split(',').map(|s| s.trim().split("::").next().unwrap_or("").trim()).collect()
            } else {
                vec![after.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or("")]
            };
            for m in names.into_iter().filter(|m| !m.is_empty() && m.chars().next().is_some_and(|c| c.is_ascii_lowercase())) {
                out.entry(m.to_string()).or_insert(n + 1);
            }
            rest = after;
        }
    }
    out
}

#[test]
fn every_import_runs_down_the_layer_table() {
    let floors = floors();
    let mut floor_of: BTreeMap<String, usize> = BTreeMap::new();
    for (i, f) in floors.iter().enumerate() {
        for m in f {
            assert!(floor_of.insert(m.clone(), floors.len() - i).is_none(), "module {m} is on the layer table twice");
        }
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for file in &files {
        let module = module_of(&src, file);
        seen.insert(module.clone());
        let Some(&mine) = floor_of.get(&module) else {
            problems.push(format!("{}: module `{module}` is not on the layer table in docs/architecture.md", file.display()));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
        for (target, line) in imports(&text) {
            if target == module {
                continue;
            }
            match floor_of.get(&target) {
                None => problems.push(format!("{}:{line}: `crate::{target}` is not on the layer table", file.display())),
                Some(&theirs) if theirs >= mine => problems.push(format!(
                    "{}:{line}: `{module}` (floor {mine}) imports `crate::{target}` (floor {theirs}): imports must run down",
                    file.display()
                )),
                Some(_) => {}
            }
        }
    }
    for m in floor_of.keys().filter(|m| !seen.contains(*m)) {
        problems.push(format!("the layer table names `{m}`, which is no module of src/"));
    }
    assert!(problems.is_empty(), "the layering is broken:\n  {}", problems.join("\n  "));
}

/// The transports (`src/transport/`) deliver into the inbox below them and know nothing
/// else of the crate above the wire: not the protocols (`proto`), not the store or the
/// token (`bootstrap`: what a transport publishes goes through the one descriptor exchange
/// that mesh setup does), not mesh setup, the fabric or anything that drives them. The
/// floors alone would allow `proto`, `prepared` and `bootstrap` (they sit lower).
#[test]
fn transports_import_only_the_inbox_and_the_base() {
    const ALLOWED: [&str; 8] = ["transport", "transport_kind", "inbox", "wire", "error", "params", "poll", "logging"];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/transport");
    let mut files = Vec::new();
    sources(&dir, &mut files);
    files.sort();
    assert!(!files.is_empty(), "no sources under {}", dir.display());
    let mut problems = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
        for (target, line) in imports(&text) {
            if !ALLOWED.contains(&target.as_str()) {
                problems.push(format!("{}:{line}: a transport imports `crate::{target}`", file.display()));
            }
        }
    }
    assert!(problems.is_empty(), "transports import only {ALLOWED:?}:\n  {}", problems.join("\n  "));
}

#[test]
fn the_scanner_sees_grouped_and_nested_paths_but_not_comments() {
    let text = "use crate::{error::Error, inbox::Inbox};\n// crate::engine\nlet x = crate::fabric::PARK_NAP; // crate::comm\n";
    let got: Vec<String> = imports(text).into_keys().collect();
    assert_eq!(got, ["error", "fabric", "inbox"]);
}
