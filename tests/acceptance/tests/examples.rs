//! Every example under examples/ is valid for the provider as built.

use lbscale_acceptance::*;
use std::path::{Path, PathBuf};

fn example_dirs(root: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(root).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            example_dirs(&p, out);
        } else if p.extension().is_some_and(|x| x == "tf") && !out.contains(&root.to_path_buf()) {
            out.push(root.to_path_buf());
        }
    }
}

#[test]
fn every_example_validates() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mut dirs = Vec::new();
    example_dirs(&root, &mut dirs);
    assert!(
        dirs.len() >= 7,
        "expected an example per resource and data source, found {dirs:?}"
    );
    let ws = Workspace::new("examples", 118);
    // The whole tree, so that a root's `source = "../../modules/..."` resolves.
    let copy = ws.dir.join("examples");
    copy_tree(&root, &copy);
    for dir in dirs {
        let rel = dir.strip_prefix(&root).unwrap();
        let chdir = format!("-chdir=examples/{}", rel.display());
        // Installs the modules a root calls (no providers: the dev override
        // serves lbscale).
        let o = ws.tf(&[&chdir, "get", "-no-color"]);
        assert_eq!(o.code, 0, "{}: terraform get:\n{}", dir.display(), o.all());
        let o = ws.tf(&[&chdir, "validate", "-no-color"]);
        assert_eq!(
            o.code,
            0,
            "{} does not validate:\n{}",
            dir.display(),
            o.all()
        );
    }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let (p, name) = (e.path(), e.file_name());
        if name.to_string_lossy().starts_with('.') {
            continue; // .terraform, .lbscale of someone's runs
        }
        if p.is_dir() {
            copy_tree(&p, &to.join(&name));
        } else {
            std::fs::copy(&p, to.join(&name)).unwrap();
        }
    }
}
