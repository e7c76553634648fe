//! The crate's module graph stays a DAG, and balancing stays apart from the
//! protocols: every `crate::m` (and a child module's `super::`) reference is
//! an edge, read from the sources themselves.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module name (`node::stats` for node/stats.rs) → the modules it refers to.
fn edges() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mut graph = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap().with_extension("");
        let name = rel
            .to_string_lossy()
            .trim_end_matches("/mod")
            .replace('/', "::");
        let parent = name.rsplit_once("::").map(|(p, _)| p.to_string());
        let text = std::fs::read_to_string(&f).unwrap();
        let mut to = BTreeSet::new();
        for line in text.lines() {
            let code = line.split("//").next().unwrap();
            for (i, _) in code.match_indices("crate::") {
                let m: String = code[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !m.is_empty() && m != name {
                    to.insert(m);
                }
            }
            // `super::` in a child file is its parent (or a sibling); in a
            // top-level file it can only be an inline test module's own file.
            if let Some(p) = &parent {
                for (i, _) in code.match_indices("super::") {
                    let m: String = code[i + 7..]
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                        .collect();
                    let sibling = format!("{p}::{m}");
                    let sibling_file = src.join(sibling.replace("::", "/") + ".rs");
                    to.insert(if !m.is_empty() && sibling_file.exists() {
                        sibling
                    } else {
                        p.clone()
                    });
                }
            }
        }
        graph.insert(name, to);
    }
    graph
}

/// A cycle through `m`, if there is one (depth-first search).
fn cycle_from(
    g: &BTreeMap<String, BTreeSet<String>>,
    m: &str,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(i) = path.iter().position(|p| p == m) {
        let mut c = path[i..].to_vec();
        c.push(m.to_string());
        return Some(c);
    }
    if done.contains(m) {
        return None;
    }
    path.push(m.to_string());
    for t in g.get(m).into_iter().flatten() {
        if let Some(c) = cycle_from(g, t, path, done) {
            return Some(c);
        }
    }
    path.pop();
    done.insert(m.to_string());
    None
}

#[test]
fn modules_form_a_dag() {
    let g = edges();
    assert!(g.len() > 10, "sources not found: {g:?}");
    let mut done = BTreeSet::new();
    for m in g.keys() {
        if let Some(c) = cycle_from(&g, m, &mut Vec::new(), &mut done) {
            panic!("module cycle: {}", c.join(" -> "));
        }
    }
}

#[test]
fn balancing_knows_no_protocol_nor_scale_out() {
    let g = edges();
    let lb: Vec<&String> = g["lb"].iter().collect();
    assert_eq!(lb, ["clock"], "lb.rs may use the clock only");
    for m in ["service", "model"] {
        for forbidden in ["http", "tcp", "udp", "listener", "node"] {
            assert!(!g[m].contains(forbidden), "{m} refers to {forbidden}");
        }
    }
}
